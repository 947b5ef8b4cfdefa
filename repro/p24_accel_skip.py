import torch
from accelerate import Accelerator
from feeder import Feeder, ImageFolder, ops
acc = Accelerator(cpu=True)
f = Feeder(ImageFolder("/tmp/rv/train"), batch_size=4, transforms=[ops.Resize((8, 8))], timeout=30)
print("hasattr dataset:", hasattr(f, "dataset"))
try:
    r = acc.skip_first_batches(f, 2); print("skip_first_batches returned", type(r).__name__)
    n = sum(1 for _ in r); print("batches", n)
except Exception as e: print(type(e).__name__, str(e)[:400])
f.close()
