import numpy as np
from feeder import Feeder, ops
JPG = open("/tmp/rv/train/class_00/img_00000.jpg", "rb").read()
for lab in ("cat", np.array(["a", "b"]), [1, 2], [[1], [2, 3]], {"a": 1}, b"x", np.array([1, 2], object), 1 + 2j, float("nan")):
    for form in ("pair", "dict"):
        class S:
            def __len__(s): return 2
            def read(s, i): return (JPG, lab) if form == "pair" else {"image": JPG, "label": lab}
        try:
            with Feeder(S(), batch_size=2, transforms=[ops.Resize((8, 8))], timeout=30) as f:
                b = next(iter(f)); l = b[1] if form == "pair" else b["label"]
                print(form, repr(lab)[:25], "-> DELIVERED", type(l).__name__, getattr(l, "dtype", ""), str(l)[:40].replace("\n", " "))
        except Exception as e: print(form, repr(lab)[:25], "->", type(e).__name__, str(e)[60:170])
