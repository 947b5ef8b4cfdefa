"""Geometric ops: image, mask and boxes must stay consistent (a white rectangle
on black, its mask 1 and its box)."""
import sys, numpy as np, cv2, simplejpeg, torch
from feeder import Feeder, ops
H, W = 90, 140
RECTS = [(20, 10, 60, 50), (70, 30, 130, 80), (0, 0, 25, 20)]  # x0,y0,x1,y1
class Src:
    def __len__(s): return 24
    def read(s, i):
        rng = np.random.default_rng(i)
        img = np.zeros((H, W, 3), np.uint8); mask = np.zeros((H, W), np.uint8)
        r = RECTS[i % 3]
        img[r[1]:r[3], r[0]:r[2]] = 255; mask[r[1]:r[3], r[0]:r[2]] = 1
        ok, png = cv2.imencode(".png", img[..., ::-1]); ok, mpng = cv2.imencode(".png", mask)
        return {"image": png.tobytes(), "mask": mpng.tobytes(),
                "boxes": np.array([r], np.float32), "box_labels": np.array([i % 3 + 1], np.int64)}
def bbox(a):
    ys, xs = np.nonzero(a)
    return None if len(xs) == 0 else (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
def check(name, transforms, tol=2):
    bad = 0
    try:
        with Feeder(Src(), batch_size=1, transforms=transforms, seed=3, timeout=30) as f:
            for k, b in enumerate(f):
                img = b["image"][0].permute(1, 2, 0).numpy(); m = b["mask"][0].numpy()
                bi = bbox(img.max(2) > 127); bm = bbox(m == 1)
                boxes = b["boxes"][0].numpy() if isinstance(b["boxes"], list) else b["boxes"][0].numpy()
                lab = b["box_labels"][0]
                if len(boxes) != len(lab): print(name, k, "boxes/labels length differ"); bad += 1
                if bi != bm and not (bi is None and bm is None):
                    if bi is None or bm is None or max(abs(x - y) for x, y in zip(bi, bm)) > tol:
                        print(name, k, "image bbox", bi, "mask bbox", bm); bad += 1
                if bm is None:
                    if len(boxes): print(name, k, "box kept w/o object", boxes); bad += 1
                else:
                    if len(boxes) != 1: print(name, k, "box dropped while visible", bm, boxes); bad += 1
                    elif max(abs(x - y) for x, y in zip(boxes[0], bm)) > tol:
                        print(name, k, "box", boxes[0].round(1), "mask bbox", bm); bad += 1
    except Exception as e:
        print(name, "ERR", type(e).__name__, str(e)[:300]); return
    print(name, "bad", bad)
tests = {
 "RandomCrop": [ops.RandomCrop(64)],
 "RandomCrop_pad": [ops.RandomCrop(128)],
 "RandomCrop_pad_end": [ops.RandomCrop(128, pad_at="end")],
 "RandomCrop_padding": [ops.RandomCrop(96, padding=8)],
 "Resize_max": [ops.Resize(80, max_size=100), ops.RandomCrop(64)],
 "RandomResize": [ops.RandomResize(40, 120), ops.RandomCrop(64)],
 "Flip": [ops.RandomHorizontalFlip(), ops.Resize((64, 64))],
 "RRC": [ops.RandomResizedCrop(64)],
 "ZoomOut": [ops.RandomZoomOut(p=1.0), ops.Resize((64, 64))],
 "IoUCrop": [ops.RandomIoUCrop(), ops.Resize((64, 64))],
 "ScaleJitter": [ops.ScaleJitter((64, 64)), ops.RandomCrop(64)],
 "ShortestSize": [ops.RandomShortestSize((40, 60, 80), 120), ops.RandomCrop(64)],
 "CenterCrop": [ops.CenterCrop(60)],
 "Resize+CenterCrop": [ops.Resize(70), ops.CenterCrop(60)],
}
for n in (sys.argv[1:] or []): check(n, tests[n])
if not sys.argv[1:]:
    for n, t in {"TA": [ops.Resize((64, 64)), ops.TrivialAugmentWide()],
                 "RA": [ops.Resize((64, 64)), ops.RandAugment(num_ops=2, magnitude=9)],
                 "RA15": [ops.Resize((64, 64)), ops.RandAugment(num_ops=2, magnitude=15)]}.items():
        check(n, t, tol=3)
