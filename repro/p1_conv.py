import os, torch, numpy as np, pickle, copy
from feeder import Feeder, ImageFolder, ops, Batch
src = ImageFolder("/tmp/rv/train")
with Feeder(src, batch_size=4, transforms=[ops.Resize((32,32))], seed=0, timeout=30) as f:
    print("len", len(f), "sampler", len(f.sampler), "dataset", len(f.dataset))
    idx = []
    for b in f:
        idx.append(b[1].tolist())
    print("labels order", idx[:3])
    x, y = f.dataset[0]; print(type(x), x.shape, x.dtype, y)
    x2, y2 = f.dataset[-1]; print(y2)
    try: f.dataset[30]
    except IndexError as e: print("IndexError ok", e)
    print(f.dataset[np.int64(1)][1])
    print(repr(f.dataset))
    # compare dataset[i] to first batch (no shuffle)
    b = next(iter(f))
    print("dataset eq batch", torch.equal(b[0][0], f.dataset[0][0]) , b[0].shape)
