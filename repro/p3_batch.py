import torch, pickle, copy, json
from feeder import Feeder, ops, Batch
import glob
class Pairs:
    def __init__(s): s.images = sorted(glob.glob("/tmp/rv/seg/images/*.jpg"))
    def __len__(s): return len(s.images)
    def read(s, i):
        m = s.images[i].replace("/images/", "/masks/").replace(".jpg", ".png")
        return {"image": open(s.images[i],"rb").read(), "mask": open(m,"rb").read()}
with Feeder(Pairs(), batch_size=4, transforms=[ops.Resize((32,32))], seed=0, timeout=30) as f:
    b = next(iter(f))
    print(type(b), list(b.keys()))
    try:
        x, y = b
    except TypeError as e: print("unpack:", e)
    from accelerate.utils import send_to_device
    c = send_to_device(b, "cpu"); print("accelerate", type(c), list(c.keys()))
    from lightning.fabric.utilities.apply_func import move_data_to_device
    c = move_data_to_device(b, torch.device("cpu")); print("lightning", type(c), list(c.keys()))
    from lightning.pytorch.utilities import move_data_to_device as m2
    c = m2(b, torch.device("cpu")); print("lightning pl", type(c))
    print("pickle", type(pickle.loads(pickle.dumps(b))), "deepcopy", type(copy.deepcopy(b)))
    print("copy", type(copy.copy(b)), type(b.copy()))
    from torch.utils._pytree import tree_map, tree_flatten
    print("tree_map", type(tree_map(lambda t: t, b)))
    print("dict()", list(dict(b)), {**b}.keys())
    print("sorted", sorted(b.items())[0][0])
    try: print("set", set(b))
    except TypeError as e: print("set(b) TypeError")
    try: print("json keys", json.dumps({k: 1 for k in b}))
    except TypeError as e: print("comprehension TypeError")
    # dataset indexing with masks
    x, t = f.dataset[0]; print("dataset", x.shape, {k: (v.shape, v.dtype) for k,v in t.items()})
    print("mask eq", torch.equal(t["mask"], b["mask"][0]))
    # lightning collate-like via default_collate on list of Batches
    from torch.utils.data import default_collate
    try: print(type(default_collate([b, b])))
    except Exception as e: print("default_collate", type(e).__name__, e)
