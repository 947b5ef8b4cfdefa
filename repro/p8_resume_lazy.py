"""Lazy orders + compact state + ordered=False + on_error='skip' + resume mid-pass,
with the thresholds lowered so a whole pass is checkable: every good sample exactly once."""
import sys, itertools, numpy as np, simplejpeg
import feeder._sampler as S, feeder._feeder as F, feeder._resume as R
N = int(sys.argv[1]) if len(sys.argv) > 1 else 997
if "--lazy" in sys.argv:
    S.LAZY_MIN = 64; F.LAZY_MIN = 64
F.COMPACT_ABOVE = 64; R.COMPACT_ABOVE = 64
from feeder import Feeder, ops
JPG = simplejpeg.encode_jpeg(np.full((16, 16, 3), 128, np.uint8), colorspace="RGB")
BAD = set(range(5, N, 37))
class Src:
    def __len__(s): return N
    def read(s, i):
        return (b"garbage" if i in BAD else JPG), i
def mk(world=1, rank=0, **kw):
    return Feeder(Src(), batch_size=8, transforms=[ops.Resize((8, 8))], seed=1, shuffle=True,
                  ordered=False, on_error="skip", decode_threads=2, timeout=30,
                  rank=rank, world_size=world, **kw)
for world in (1, 2):
  for stop in (0, 3, 17, 60):
    seen_all = []
    for rank in range(world):
        f = mk(world, rank); f.set_epoch(2)
        seen = []
        it = iter(f)
        for b in itertools.islice(it, stop): seen += b[1].tolist()
        st = f.state_dict(); f.close()
        g = mk(world, rank); g.load_state_dict(st)
        for b in g: seen += b[1].tolist()
        # the next epoch after the resumed pass must be a full one
        nxt = sum(len(b[1]) for b in g)
        g.close()
        seen_all += seen
    good = set(range(N)) - BAD
    dup = len(seen_all) - len(set(seen_all))
    print(f"world {world} stop {stop}: version {st['version']} delivered {len(seen_all)} dup {dup} "
          f"missing {len(good - set(seen_all))} bad_delivered {len(BAD & set(seen_all))} next-pass {nxt}")
