"""RandomCrop(mask_fill=300) on an 8-bit mask: the padding value cannot be stored in uint8."""
import glob, torch
from feeder import Feeder, ops
class Pairs:
    def __init__(s): s.images = sorted(glob.glob("/tmp/rv/seg/images/*.jpg"))
    def __len__(s): return len(s.images)
    def read(s, i):
        m = s.images[i].replace("/images/", "/masks/").replace(".jpg", ".png")
        return {"image": open(s.images[i], "rb").read(), "mask": open(m, "rb").read()}
for fill in (255, 300, 256):
    try:
        with Feeder(Pairs(), batch_size=4, transforms=[ops.RandomCrop(160, mask_fill=fill)], seed=0, timeout=30) as f:
            b = next(iter(f)); m = b["mask"]
            print("mask_fill", fill, "mask dtype", m.dtype, "values", torch.unique(m).tolist())
    except Exception as e: print("mask_fill", fill, type(e).__name__, str(e)[:250])
try:
    with Feeder(Pairs(), batch_size=4, transforms=[ops.Resize((32, 32))], dtype=torch.float32,
                batch_transforms=[ops.RandomErasing(p=1, value=(1, 2))], seed=0, timeout=30) as f:
        b = next(iter(f)); print("RandomErasing value=(1,2): ran", b["image"].shape)
except Exception as e: print("RandomErasing value=(1,2)", type(e).__name__, str(e)[:250])
