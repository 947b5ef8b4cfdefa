import numpy as np, torch, albumentations as A
from feeder import Feeder, ImageFolder, ops
src = ImageFolder("/tmp/rv/train")
def t(name, transforms, **kw):
    try:
        if callable(transforms) and not isinstance(transforms, list): transforms = transforms()
        kw = {k: (v() if k == "batch_transforms" and callable(v) else v) for k, v in kw.items()}
        with Feeder(src, batch_size=5, transforms=transforms, seed=0, timeout=30, **kw) as f:
            b = next(iter(f)); print(name, "OK", tuple(b[0].shape))
    except Exception as e: print(name, "ERR", type(e).__name__, str(e)[:300])
t("ColorJitter bad", lambda: [ops.Resize((32,32)), ops.ColorJitter(brightness=-1)])
t("ColorJitter hue bad", lambda: [ops.Resize((32,32)), ops.ColorJitter(hue=0.9)])
t("RandomCrop 0", lambda: [ops.Resize((32,32)), ops.RandomCrop(0)])
t("RandomCrop no pad too small", lambda: [ops.Resize((32,32)), ops.RandomCrop(48, pad_if_needed=False)])
t("RandomResize min>max", lambda: [ops.RandomResize(100, 50), ops.RandomCrop(32)])
t("RandAugment mag 40", lambda: [ops.Resize((32,32)), ops.RandAugment(magnitude=40)])
t("RandAugment num_ops -1", lambda: [ops.Resize((32,32)), ops.RandAugment(num_ops=-1)])
t("TA bins 0", lambda: [ops.Resize((32,32)), ops.TrivialAugmentWide(num_magnitude_bins=0)])
t("Resize max_size < size", lambda: [ops.Resize(64, max_size=32), ops.CenterCrop(16)])
t("Resize tuple + max_size", lambda: [ops.Resize((64, 64), max_size=100)])
t("RandomErasing as transform", lambda: [ops.Resize((32,32)), ops.RandomErasing()])
t("RandomErasing p=2", lambda: [ops.Resize((32,32))], batch_transforms=lambda: [ops.RandomErasing(p=2)])
t("RandomErasing value random", lambda: [ops.Resize((32,32))], batch_transforms=lambda: [ops.RandomErasing(p=1, value="random")], normalize=((0.5,)*3,(0.5,)*3))
t("RandomErasing uint8", lambda: [ops.Resize((32,32))], batch_transforms=lambda: [ops.RandomErasing(p=1)])
t("RandomErasing bad scale", lambda: [ops.Resize((32,32))], batch_transforms=lambda: [ops.RandomErasing(scale=(0.5, 0.1))])
t("Kornia on pairs", lambda: [ops.Resize((32,32))], batch_transforms=lambda: [ops.Kornia(__import__('kornia').augmentation.RandomHorizontalFlip())], dtype=torch.float32)
