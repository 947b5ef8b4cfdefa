"""A 2-field Batch (image + mask) through a real Lightning fit: any internal iteration of the batch?"""
import glob, torch, lightning as L, logging
logging.disable(logging.WARNING)
from feeder import Feeder, ops
class Pairs:
    def __init__(s): s.images = sorted(glob.glob("/tmp/rv/seg/images/*.jpg"))
    def __len__(s): return len(s.images)
    def read(s, i):
        m = s.images[i].replace("/images/", "/masks/").replace(".jpg", ".png")
        return {"image": open(s.images[i], "rb").read(), "mask": open(m, "rb").read()}
class M(L.LightningModule):
    def __init__(s): super().__init__(); s.c = torch.nn.Conv2d(3, 4, 1)
    def training_step(s, batch, i):
        loss = torch.nn.functional.cross_entropy(s.c(batch["image"]), batch["mask"].long(), ignore_index=255)
        s.log("loss", loss)  # Lightning extracts the batch size from the batch here
        return loss
    def configure_optimizers(s): return torch.optim.SGD(s.parameters(), 0.1)
f = Feeder(Pairs(), batch_size=4, transforms=[ops.Resize((16, 16))], dtype=torch.float32, timeout=30)
t = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False)
try:
    t.fit(M(), train_dataloaders=f); print("fit OK, steps", t.global_step)
except Exception as e: print("fit", type(e).__name__, str(e)[:300])
f.close()
