import numpy as np, torch, albumentations as A
from feeder import Feeder, ImageFolder, ops
src = ImageFolder("/tmp/rv/train")
def run(threads, ordered=True, iso="thread", epoch=0):
    aug = ops.Albumentations(A.Compose([A.RandomCrop(40, 40), A.HorizontalFlip(), A.GaussNoise(p=0.5),
                                        A.RandomBrightnessContrast(p=0.5)]), output_size=40)
    with Feeder(src, batch_size=5, transforms=[ops.Resize(64), aug], seed=0, decode_threads=threads,
                timeout=60, isolation=iso) as f:
        f.set_epoch(epoch)
        return torch.cat([b[0] for b in f])
a = run(1); b = run(2); c = run(1, epoch=1)
print("threads 1 vs 2 equal:", torch.equal(a, b), "epoch differs:", not torch.equal(a, c))
print("again equal:", torch.equal(a, run(2)))
print("process == thread:", torch.equal(a, run(2, iso="process")))
