"""Region decode vs simplejpeg: same batches? (run twice, with FEEDER_NO_JPEG_EXT=1)"""
import os, sys, torch, feeder
from feeder import Feeder, ImageFolder, ops
print(feeder.info()["jpeg"] if isinstance(feeder.info(), dict) else feeder.info())
out = {}
for name, t in {"cc": [ops.CenterCrop(48)], "rcc": [ops.Resize(64), ops.CenterCrop(56)],
                "rrc": [ops.RandomResizedCrop(32)], "rrc_big": [ops.RandomResizedCrop(200)],
                "cc_big": [ops.CenterCrop(160)], "crop_then_flip": [ops.CenterCrop(40), ops.RandomHorizontalFlip()]}.items():
    with Feeder(ImageFolder("/tmp/rv/train"), batch_size=10, transforms=t, seed=0, timeout=30) as f:
        out[name] = torch.cat([b[0] for b in f])
torch.save(out, sys.argv[1])
