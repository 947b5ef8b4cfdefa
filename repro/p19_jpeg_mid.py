import numpy as np, simplejpeg, feeder
from feeder import Feeder, ops
good = simplejpeg.encode_jpeg(np.random.default_rng(0).integers(0, 255, (256, 256, 3), dtype=np.uint8), colorspace="RGB")
n = len(good)
cases = {f"xor@{frac}": good[:int(n*frac)] + bytes(x ^ 0x5A for x in good[int(n*frac):int(n*frac)+64]) + good[int(n*frac)+64:] for frac in (0.3, 0.6, 0.95)}
cases["RST-free truncation at 0.9 + EOI"] = good[:int(n*0.9)] + b"\xff\xd9"
print(feeder.info()["jpeg"]["decoder"])
for name, data in cases.items():
    for t in ([ops.Resize((32, 32))], [ops.CenterCrop(32)]):
        class S:
            def __len__(s): return 2
            def read(s, i): return data, 0
        try:
            with Feeder(S(), batch_size=2, transforms=t, timeout=30) as f:
                b = next(iter(f)); print(name, t[0].__class__.__name__, "DELIVERED")
        except Exception as e: print(name, t[0].__class__.__name__, "->", type(e).__name__, str(e)[70:200])
