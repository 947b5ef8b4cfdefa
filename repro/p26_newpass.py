from feeder import Feeder, ImageFolder, ops, FeederError
with Feeder(ImageFolder("/tmp/rv/train"), batch_size=4, transforms=[ops.Resize((8, 8))], timeout=30) as f:
    a = iter(f); next(a); b = iter(f); next(b)
    try: next(a); print("old iterator continued")
    except FeederError as e: print("FeederError:", str(e)[:150])
    print("new pass batches:", 1 + sum(1 for _ in b))
