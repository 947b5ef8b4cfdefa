import os, torch, numpy as np, pickle, copy
from feeder import Feeder, ImageFolder, ops, Batch
src = ImageFolder("/tmp/rv/train")
os.environ["RANK"]="1"; os.environ["WORLD_SIZE"]="2"
f = Feeder(src, batch_size=4, transforms=[ops.Resize((32,32))], seed=0, timeout=30)
print("env rank: len", len(f), "sampler", len(f.sampler), "dataset", len(f.dataset), f.rank if hasattr(f,'rank') else '')
n=0
for b in f: n += len(b[1])
print("samples seen", n)
f.close()
f = Feeder(src, batch_size=4, transforms=[ops.Resize((32,32))], seed=0, timeout=30, drop_last=True)
print("drop_last: len", len(f), "sampler", len(f.sampler)); f.close()
os.environ["RANK"]="x"
try: Feeder(src, batch_size=4, transforms=[ops.Resize((32,32))])
except Exception as e: print(type(e).__name__, e)
del os.environ["RANK"]; del os.environ["WORLD_SIZE"]
class S:
    def __len__(self): return 4
    def read(self, i):
        return open(src.files[i] if hasattr(src,'files') else "/tmp/rv/train/class_00/img_00000.jpg","rb").read(), ["cat","dog","a","b"][i]
for lab in (["cat"]*4, [1.5]*4, [None]*4, [True]*4, [np.int64(2)]*4, [2**40]*4, [torch.tensor(1)]*4, [np.array([1,2])]*4):
    class T(S):
        def read(self, i, lab=lab):
            return open("/tmp/rv/train/class_00/img_00000.jpg","rb").read(), lab[i]
    try:
        with Feeder(T(), batch_size=2, transforms=[ops.Resize((32,32))], timeout=30) as f:
            b = next(iter(f)); print(repr(lab[0]), "->", b[1].dtype, b[1].tolist())
    except Exception as e: print(repr(lab[0]), "ERR", type(e).__name__, str(e)[:200])
