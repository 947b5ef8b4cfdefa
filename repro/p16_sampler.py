import torch
from feeder import Feeder, ImageFolder, ops
src = ImageFolder("/tmp/rv/train")
with Feeder(src, batch_size=5, transforms=[ops.Resize((8, 8))], shuffle=True, seed=0, timeout=30) as f:
    s = f.sampler; print(type(s).__name__, len(s), [a for a in dir(s) if not a.startswith("_")])
    a = [b[1].tolist() for b in f]
    s.set_epoch(5); b5 = [b[1].tolist() for b in f]
    f.set_epoch(5); c5 = [b[1].tolist() for b in f]
    print("sampler.set_epoch == feeder.set_epoch:", b5 == c5, "differs from epoch 0:", a != b5)
    try: print("iter(sampler):", list(iter(s))[:5])
    except Exception as e: print("iter(sampler)", type(e).__name__, e)
    print("dataset[i] during a pass:")
    it = iter(f); next(it); x = f.dataset[3]; print(" ok", x[1]); it.close() if hasattr(it, "close") else None
