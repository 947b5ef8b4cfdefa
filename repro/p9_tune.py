import torch, time
from feeder import Feeder, ImageFolder, ops
src = ImageFolder("/tmp/rv/train")
for kw in (dict(isolation="process"), dict(augment_threads=1), dict(ordered=False), dict(read_threads=4)):
    try:
        with Feeder(src, batch_size=4, transforms=[ops.Resize((32, 32))], decode_threads="tune", timeout=60, seed=0, **kw) as f:
            n = sum(len(b[1]) for b in f)
            s = f.stats()
            print(kw, "OK", n, "active_threads", getattr(s, "active_threads", None))
    except Exception as e: print(kw, "ERR", type(e).__name__, str(e)[:300])
for bad in ("Tune", "tune ", 0, -1, 2.5, True):
    try: Feeder(src, batch_size=4, transforms=[ops.Resize((32, 32))], decode_threads=bad); print(repr(bad), "accepted")
    except Exception as e: print(repr(bad), type(e).__name__, str(e)[:150])
