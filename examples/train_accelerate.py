"""Training and exact evaluation with Hugging Face Accelerate, fed by feeder.

A tiny model on generated images, seconds on the CPU. Run it in one process,
or in several (each rank trains on its own shard; the evaluation counts every
sample once across the ranks):

    python examples/train_accelerate.py
    accelerate launch --cpu --num_processes 2 examples/train_accelerate.py
    torchrun --nproc_per_node 2 examples/train_accelerate.py

What it shows:

* ``accelerator.prepare(feeder)`` returns the feeder unchanged (Accelerate
  prepares DataLoaders, models, optimizers and schedulers; the feeder already
  shards by ``torch.distributed`` and puts batches on ``device`` itself), so
  preparing only the model and the optimizer is enough.
* Resuming mid-epoch, two ways: each rank saves ``feeder.state_dict()`` next
  to ``accelerator.save_state()`` (Accelerate's ``register_for_checkpointing``
  saves the main process's objects only, and each rank's feeder state is its
  own), or, as Accelerate's ``skip_first_batches`` does for a DataLoader,
  ``feeder.set_epoch(epoch)`` then ``feeder.skip(step_in_epoch)``. Either way
  the skipped batches are not read at all, and the rest are the uninterrupted
  run's.
* Exact evaluation: with ``drop_last=False`` the ranks' shards cover every
  sample once (their sizes differ by at most one, so their batch counts may
  differ too). Predictions are kept on each rank and gathered once, after the
  loop: ``pad_across_processes`` + ``gather``, then the padding is cut off with
  ``feeder.shard_sizes()``.

It prints one line per fact, e.g. ``epoch 0: 64 samples, every sample once:
True, loss 1.38`` (the counts are summed over the ranks).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import simplejpeg
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch import nn

from feeder import Feeder, ops
from feeder.synthetic import make_image

CLASSES = 4


class GeneratedImages:
    """``count`` small photograph-like JPEGs in memory; sample ``i`` has label ``i % 4``."""

    def __init__(self, count: int, side: int = 24, seed: int = 0) -> None:
        self.blobs = [simplejpeg.encode_jpeg(make_image(side, side, seed + i), colorspace="RGB")
                      for i in range(count)]

    def __len__(self) -> int:
        return len(self.blobs)

    def read(self, index: int) -> tuple[bytes, int]:
        return self.blobs[index], index % CLASSES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--train-images", type=int, default=64)
    # 49 on 2 ranks: shards of 25 and 24 samples, 4 and 3 batches of 8.
    p.add_argument("--eval-images", type=int, default=49)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--resume-step", type=int, default=3, help="batches to skip when resuming")
    args = p.parse_args()

    train_source = GeneratedImages(args.train_images)
    eval_source = GeneratedImages(args.eval_images, seed=10_000)

    def train_feeder() -> Feeder:
        # Built before the process group exists (Accelerator() creates it): the
        # feeder reads the ranks when each pass starts.
        return Feeder(train_source, args.batch_size, [ops.RandomResizedCrop(16), ops.RandomHorizontalFlip()],
                      normalize=((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)), shuffle=True, drop_last=True,
                      seed=0, decode_threads=2)

    train = train_feeder()
    evaluate = Feeder(eval_source, args.batch_size, [ops.CenterCrop(16)], dtype=torch.float32,
                      shuffle=False, drop_last=False, decode_threads=2)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 32), nn.ReLU(), nn.Linear(32, CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, prepared = accelerator.prepare(model, opt, train)
    say = accelerator.print
    say(f"prepare(feeder) returns it unchanged: {prepared is train}; "
        f"{accelerator.num_processes} process(es), {len(train)} batches per epoch per rank")

    def gather_indices(indices: list[int]) -> list[int]:
        # Every rank's list, concatenated (gather_object pickles: fine for a check).
        return accelerator.gather_for_metrics(indices, use_gather_object=True)

    # -- training: each rank its own shard, reshuffled every epoch ----------------------
    checkpoint = tempfile.mkdtemp() if accelerator.is_main_process else None
    checkpoint = broadcast_object_list([checkpoint])[0]
    order = []  # this rank's batches (sample indices), to check the resumes below
    for epoch in range(args.epochs):
        train.set_epoch(epoch)
        model.train()
        seen, loss_sum = [], torch.zeros(())
        for step, (images, labels) in enumerate(train):
            loss = nn.functional.cross_entropy(model(images), labels)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            seen += train.last_batch.indices.tolist()
            order.append(train.last_batch.indices.tolist())
            loss_sum += loss.detach() * len(labels)
            if (epoch, step + 1) == (args.epochs - 1, args.resume_step):
                # A checkpoint: Accelerate saves the model and the optimizer; each
                # rank saves its own feeder state (its shard and position differ
                # from the other ranks').
                accelerator.save_state(checkpoint)
                torch.save(train.state_dict(),
                           os.path.join(checkpoint, f"feeder_rank{accelerator.process_index}.pt"))
        everyone = gather_indices(seen)
        loss = accelerator.reduce(loss_sum, "sum").item() / len(everyone)
        whole = len(train_source) // accelerator.num_processes * accelerator.num_processes
        say(f"epoch {epoch}: {len(everyone)} samples, every sample once: "
            f"{len(set(everyone)) == len(everyone) == whole}, loss {loss:.2f}")

    # -- resume mid-epoch, as a restarted job would -------------------------------------
    epoch, step = args.epochs - 1, args.resume_step
    expected = order[epoch * len(train) + step:(epoch + 1) * len(train)]

    def on_every_rank(ok: bool) -> bool:
        return accelerator.reduce(torch.tensor(int(ok)), "sum").item() == accelerator.num_processes

    accelerator.load_state(checkpoint)  # the model and the optimizer
    # (1) From the feeder's own state: exact for any settings.
    resumed = train_feeder()
    mine = os.path.join(checkpoint, f"feeder_rank{accelerator.process_index}.pt")
    resumed.load_state_dict(torch.load(mine))
    rest = [resumed.last_batch.indices.tolist() for _ in resumed]
    resumed.close()
    say(f"resume from the feeder's state: epoch {epoch} from batch {step}: the uninterrupted run's "
        f"batches: {on_every_rank(rest == expected)}")
    # (2) From the step count alone, as skip_first_batches does for a DataLoader.
    resumed = train_feeder()
    resumed.set_epoch(epoch)
    resumed.skip(step)  # the first `step` batches of this epoch are not read at all
    rest = [resumed.last_batch.indices.tolist() for _ in resumed]
    resumed.close()
    say(f"resume with skip({step}): epoch {epoch} from batch {step}: the uninterrupted run's "
        f"batches: {on_every_rank(rest == expected)}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(checkpoint)

    # -- exact evaluation: every sample once across the ranks ---------------------------
    # Ranks may run different numbers of batches: no collective call inside the
    # loop. The unwrapped model, as DDP's forward may broadcast buffers (BatchNorm's).
    net = accelerator.unwrap_model(model).eval()
    preds, indices = [], []
    with torch.no_grad():
        for images, labels in evaluate:
            preds.append(net(images).argmax(1))
            indices.append(evaluate.last_batch.indices)
    preds, indices = torch.cat(preds), torch.cat(indices)
    sizes = evaluate.shard_sizes()  # every rank's sample count, the same list on every rank

    def gather_exact(local: torch.Tensor) -> torch.Tensor:
        padded = accelerator.gather(accelerator.pad_across_processes(local))  # [ranks * longest]
        longest = len(padded) // accelerator.num_processes
        return torch.cat([padded[r * longest:r * longest + n] for r, n in enumerate(sizes)])

    all_preds, all_indices = gather_exact(preds), gather_exact(indices)
    labels = all_indices % CLASSES
    batches = accelerator.gather(torch.tensor([len(evaluate)])).tolist()
    say(f"eval: {len(all_indices)} samples (shards {sizes}, batches {batches}), every sample once: "
        f"{sorted(all_indices.tolist()) == list(range(len(eval_source)))}, "
        f"accuracy {(all_preds == labels).float().mean().item():.2f}")

    train.close()
    evaluate.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
