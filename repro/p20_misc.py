import json, numpy as np, torch
from feeder import Feeder, ops, Batch
class Det:
    def __init__(s): s.r = json.load(open("/tmp/rv/det/annotations.json"))
    def __len__(s): return len(s.r)
    def read(s, i):
        r = s.r[i]
        return {"image": open(r["image"], "rb").read(), "boxes": np.asarray(r["boxes"], np.float32).reshape(-1, 4),
                "box_labels": np.asarray(r["labels"], np.int64), "label": i}
T = [ops.RandomHorizontalFlip(), ops.Resize((48, 48))]
for iso in ("thread", "process"):
    with Feeder(Det(), batch_size=4, transforms=T, seed=0, timeout=60, isolation=iso) as f:
        b = next(iter(f))
        print(iso, type(b).__name__, list(b), type(b["boxes"]).__name__)
        x, t = f.dataset[2]
        print(" dataset:", x.shape, {k: (tuple(v.shape) if hasattr(v, "shape") else v) for k, v in t.items()})
        print(" boxes equal batch:", torch.equal(t["boxes"], b["boxes"][2]), "label", t["label"], b["label"][2].item())
