"""A real > 2^24-sample source: lazy order, compact state, resume mid-pass (ordered=False + skip)."""
import itertools, pickle, time, numpy as np, simplejpeg, logging
logging.disable(logging.WARNING)
from feeder import Feeder, ops
JPG = simplejpeg.encode_jpeg(np.full((8, 8, 3), 9, np.uint8), colorspace="RGB")
N = (1 << 25) + 7
class Huge:
    def __len__(s): return N
    def read(s, i): return (b"bad" if i % 97 == 0 else JPG), i
def mk(**kw): return Feeder(Huge(), batch_size=16, image_size=(8, 8), seed=3, shuffle=True, ordered=False,
                            on_error="skip", rank=1, world_size=3, timeout=30, **kw)
t0 = time.time(); f = mk(); f.set_epoch(7); print("construct", round(time.time() - t0, 2), "s, len", len(f))
it = iter(f); first = [x for b in itertools.islice(it, 20) for x in b[1].tolist()]
st = f.state_dict(); f.close(); print("state bytes", len(pickle.dumps(st)), {k: st[k] for k in ("version", "epoch", "position")})
g = mk(); g.load_state_dict(st); it = iter(g)
second = [x for b in itertools.islice(it, 20) for x in b[1].tolist()]; g.close()
print("overlap", len(set(first) & set(second)), "dups", len(first) + len(second) - len(set(first + second)),
      "bad delivered", sum(x % 97 == 0 for x in first + second), "rank-1 only", all(x % 3 == 1 for x in first) )
