"""Damaged JPEGs through the region decoder (and simplejpeg with FEEDER_NO_JPEG_EXT=1)."""
import numpy as np, simplejpeg, feeder, struct
from feeder import Feeder, ops
good = simplejpeg.encode_jpeg(np.random.default_rng(0).integers(0, 255, (96, 128, 3), dtype=np.uint8), colorspace="RGB")
def set_dims(b, h, w):
    i = b.index(b"\xff\xc0")
    return b[:i + 5] + struct.pack(">HH", h, w) + b[i + 9:]
cases = {"truncated half": good[:len(good) // 2], "truncated header": good[:50],
         "huge dims": set_dims(good, 60000, 60000), "zero dims": set_dims(good, 0, 128),
         "garbage after SOI": b"\xff\xd8" + bytes(500), "flipped bytes": good[:300] + bytes(x ^ 0x55 for x in good[300:600]) + good[600:]}
print(feeder.info()["jpeg"]["decoder"])
for name, data in cases.items():
    for t in ([ops.CenterCrop(32)], [ops.RandomResizedCrop(32)], [ops.Resize((32, 32))]):
        class S:
            def __len__(s): return 2
            def read(s, i): return data, 0
        try:
            with Feeder(S(), batch_size=2, transforms=t, timeout=30) as f:
                b = next(iter(f)); print(name, t[0].__class__.__name__, "DELIVERED", b[0].float().mean().item())
        except Exception as e: print(name, t[0].__class__.__name__, "->", type(e).__name__, str(e)[:170])
