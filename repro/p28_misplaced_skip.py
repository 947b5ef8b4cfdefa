"""On main: a batch transform in transforms under on_error="skip" skips every sample (0 batches, no error)."""
import logging; logging.disable(logging.WARNING)
from feeder import Feeder, ImageFolder, ops
f = Feeder(ImageFolder("/tmp/rv/train"), batch_size=4, transforms=[ops.Resize((8, 8)), ops.RandomErasing()], on_error="skip", timeout=30)
try:
    with f: n = sum(len(b[1]) for b in f); print("delivered", n, "skipped", f.stats().skipped)
except Exception as e: print(type(e).__name__, str(e)[:200])
