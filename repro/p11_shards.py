"""shuffle='shards' + shuffle_shards + lazy_index: exactly once across ranks, and resume mid-pass."""
import itertools, os, numpy as np, simplejpeg, logging
from feeder import Feeder, TarShards, ops
from feeder.pack import pack
N = 203
JPG = simplejpeg.encode_jpeg(np.full((16, 16, 3), 100, np.uint8), colorspace="RGB")
class Src:
    def __len__(s): return N
    def read(s, i): return JPG, i
if not os.path.exists("/tmp/rv/shards/train.json"):
    pack(Src(), "/tmp/rv/shards", shard_size=20 * len(JPG))
print(len(os.listdir("/tmp/rv/shards")), "files")
def mk(world, rank, drop_last, **kw):
    return Feeder(TarShards("/tmp/rv/shards/train.json", lazy_index=True, index_cache=4), batch_size=8,
                  transforms=[ops.Resize((8, 8))], shuffle="shards", shuffle_shards=2, seed=0, timeout=30,
                  rank=rank, world_size=world, drop_last=drop_last, **kw)
for world in (1, 2, 3):
    for drop_last in (False, True):
        for stop in (None, 5):
            seen, lens = [], []
            for r in range(world):
                f = mk(world, r, drop_last); f.set_epoch(1)
                part = []
                if stop is None:
                    for b in f: part += b[1].tolist()
                else:
                    it = iter(f)
                    for b in itertools.islice(it, stop): part += b[1].tolist()
                    st = f.state_dict(); f.close()
                    f = mk(world, r, drop_last); f.load_state_dict(st)
                    for b in f: part += b[1].tolist()
                lens.append((len(f), len(part))); f.close(); seen += part
            print(f"world {world} drop_last {drop_last} resume@{stop}: total {len(seen)} unique {len(set(seen))} "
                  f"missing {N - len(set(seen))} (len, samples) per rank {lens}")
