"""RandomErasing (and Kornia) on dict batches without a "label" field (segmentation, detection)."""
import glob, torch, kornia
from feeder import Feeder, ops
class Pairs:
    def __init__(s): s.images = sorted(glob.glob("/tmp/rv/seg/images/*.jpg"))
    def __len__(s): return len(s.images)
    def read(s, i):
        m = s.images[i].replace("/images/", "/masks/").replace(".jpg", ".png")
        return {"image": open(s.images[i], "rb").read(), "mask": open(m, "rb").read()}
class ImagesOnly(Pairs):
    def read(s, i): return {"image": open(s.images[i], "rb").read()}
for name, src, bt in (("seg + RandomErasing", Pairs(), [ops.RandomErasing(p=1)]),
                      ("image-only dict + RandomErasing", ImagesOnly(), [ops.RandomErasing(p=1)]),
                      ("image-only dict + Kornia", ImagesOnly(), [ops.Kornia(kornia.augmentation.RandomHorizontalFlip())])):
    try:
        with Feeder(src, batch_size=4, transforms=[ops.Resize((32, 32))], dtype=torch.float32,
                    batch_transforms=bt, seed=0, timeout=30) as f:
            b = next(iter(f)); print(name, "OK", b["image"].shape)
    except Exception as e: print(name, "->", type(e).__name__, str(e)[:300])
