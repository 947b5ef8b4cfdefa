"""feeder.dataset[i] vs the batch holding sample i, with a random flip."""
import json, numpy as np, torch
from feeder import Feeder, ops
exec(open("repro/p20_misc.py").read().split("T = [")[0])
T = [ops.RandomHorizontalFlip(), ops.Resize((48, 48))]
with Feeder(Det(), batch_size=4, transforms=T, seed=0, timeout=60) as f:
    before = f.dataset[2]
    it = iter(f); b = next(it)
    during = f.dataset[2]
    rest = list(it)
    after = f.dataset[2]
    print("before pass == batch:", torch.equal(before[1]["boxes"], b["boxes"][2]), torch.equal(before[0], b["image"][2]))
    print("during pass == batch:", torch.equal(during[1]["boxes"], b["boxes"][2]))
    print("after pass == batch:", torch.equal(after[1]["boxes"], b["boxes"][2]))
    f.set_epoch(0)
    print("after set_epoch(0) == batch:", torch.equal(f.dataset[2][1]["boxes"], b["boxes"][2]))
