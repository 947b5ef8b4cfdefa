import time, threading
from feeder import Feeder, ops
JPG = open("/tmp/rv/train/class_00/img_00000.jpg", "rb").read()
ev = threading.Event()
class Slow:
    def __len__(s): return 8
    def read(s, i):
        if i == 3: ev.wait(60)
        return JPG, 0
for kw in (dict(), dict(decode_threads="tune"), dict(ordered=False, on_error="skip"), dict(isolation="process")):
    t0 = time.time()
    try:
        with Feeder(Slow(), batch_size=2, transforms=[ops.Resize((8, 8))], timeout=2, **kw) as f:
            n = sum(1 for _ in f); print(kw, "finished?", n)
    except Exception as e: print(kw, type(e).__name__, str(e)[:140])
    print("  took", round(time.time() - t0, 1), "s")
ev.set()
