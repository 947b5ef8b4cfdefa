"""A feeder op in the wrong list: expected a construction-time TypeError naming the right list."""
import torch, albumentations as A
from feeder import Feeder, ImageFolder, ops
src = ImageFolder("/tmp/rv/train")
cases = {
  "RandomErasing in transforms": dict(transforms=[ops.Resize((32, 32)), ops.RandomErasing()]),
  "MixUp in transforms": dict(transforms=[ops.Resize((32, 32)), ops.MixUp(0.2, num_classes=3)]),
  "ColorJitter in batch_transforms": dict(transforms=[ops.Resize((32, 32))], batch_transforms=[ops.ColorJitter(0.2)]),
  "bare A.Compose in transforms": dict(transforms=[ops.Resize((32, 32)), A.Compose([A.HorizontalFlip()])]),
}
for name, kw in cases.items():
    try:
        f = Feeder(src, batch_size=4, timeout=30, **kw)
    except TypeError as e:
        print(name, "-> construction TypeError:", str(e)[:160]); continue
    try:
        with f: next(iter(f)); print(name, "-> ran (no error)")
    except Exception as e: print(name, "-> only at the first batch:", type(e).__name__, str(e)[:160])
