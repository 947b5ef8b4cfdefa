"""Training with PyTorch Lightning, fed by feeder, with a mid-epoch checkpoint and resume.

A tiny model on generated images, seconds on the CPU:

    python examples/train_lightning.py

What it shows:

* ``train_dataloader()`` / ``val_dataloader()`` return Feeders. Lightning sets
  each training epoch's number through ``feeder.sampler.set_epoch`` (as it
  does for a DataLoader's sampler), and its ``iter()`` probes start nothing,
  so epoch ``e`` gets the order and crops of ``(seed, e)``: a new order every
  epoch, each sample once.
* Lightning saves the feeder's ``state_dict()`` in its checkpoints (a loader
  with ``state_dict``/``load_state_dict``) and loads it on
  ``trainer.fit(..., ckpt_path=...)``: a run resumed from a mid-epoch
  checkpoint, with a new Trainer and a new Feeder, trains on exactly the
  batches the uninterrupted run trained on after that step.

It prints one line per fact, e.g. ``epoch 1: 64 samples, every sample once:
True, new order: True``.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings

import lightning as L
import simplejpeg
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
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


class Classifier(L.LightningModule):
    def __init__(self, train_source: GeneratedImages, val_source: GeneratedImages, batch_size: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 32), nn.ReLU(), nn.Linear(32, CLASSES))
        # Feeders may be built here, before any process group exists: they read
        # the ranks when each pass starts.
        self.train_feeder = Feeder(
            train_source, batch_size, [ops.RandomResizedCrop(16), ops.RandomHorizontalFlip()],
            normalize=((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)), shuffle=True, drop_last=True, seed=0,
            decode_threads=2)
        self.val_feeder = Feeder(val_source, batch_size, [ops.CenterCrop(16)], dtype=torch.float32,
                                 shuffle=False, drop_last=False, decode_threads=2)
        self.trained_on: list[tuple[int, list[int]]] = []  # (epoch, sample indices) per step
        self.val_runs: list[list[int]] = []  # sample indices per validation run

    def train_dataloader(self) -> Feeder:
        return self.train_feeder

    def val_dataloader(self) -> Feeder:
        return self.val_feeder

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        self.trained_on.append((self.current_epoch, self.train_feeder.last_batch.indices.tolist()))
        loss = nn.functional.cross_entropy(self.net(images), labels)
        self.log("loss", loss, prog_bar=False)
        return loss

    def on_validation_epoch_start(self) -> None:
        self.val_runs.append([])

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        self.val_runs[-1] += self.val_feeder.last_batch.indices.tolist()
        self.log("val_acc", (self.net(images).argmax(1) == labels).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def close(self) -> None:
        self.train_feeder.close()
        self.val_feeder.close()


def trainer(max_epochs: int, **kw) -> L.Trainer:
    return L.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, **kw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-images", type=int, default=64)
    p.add_argument("--val-images", type=int, default=21)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--checkpoint-step", type=int, default=11, help="a step inside the second epoch")
    args = p.parse_args()
    warnings.filterwarnings("ignore", module="lightning")  # tips about loggers, ...
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    train_source = GeneratedImages(args.train_images)
    val_source = GeneratedImages(args.val_images, seed=10_000)

    with tempfile.TemporaryDirectory() as ckpt_dir:
        # The uninterrupted run, checkpointing every `checkpoint_step` steps.
        model = Classifier(train_source, val_source, args.batch_size)
        every = ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=args.checkpoint_step,
                                save_top_k=-1)
        trainer(args.epochs, callbacks=[every]).fit(model)
        model.close()
        epochs = [[i for e, batch in model.trained_on if e == epoch for i in batch]
                  for epoch in range(args.epochs)]
        for epoch, seen in enumerate(epochs):
            new = epoch == 0 or seen != epochs[epoch - 1]
            print(f"epoch {epoch}: {len(seen)} samples, every sample once: "
                  f"{sorted(seen) == list(range(len(train_source)))}, new order: {new}")
        # The first validation run is Lightning's sanity check (2 batches).
        full = model.val_runs[1:]
        print(f"validation: {len(full)} runs after the sanity check, every sample once in each: "
              f"{all(sorted(r) == list(range(len(val_source))) for r in full)}")

        # A new job: a new model, new feeders, a new Trainer, resumed from the
        # mid-epoch checkpoint.
        path = os.path.join(ckpt_dir, f"step={args.checkpoint_step}.ckpt")
        saved = torch.load(path, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        resumed = Classifier(train_source, val_source, args.batch_size)
        trainer(args.epochs, enable_checkpointing=False).fit(resumed, ckpt_path=path)
        resumed.close()
        same = resumed.trained_on == model.trained_on[args.checkpoint_step:]
        print(f"checkpoint at step {args.checkpoint_step} holds the feeder's state (epoch "
              f"{saved[0]['epoch']}, {saved[0]['batches']} batches delivered)")
        print(f"resumed from step {args.checkpoint_step}: {len(resumed.trained_on)} steps, "
              f"the uninterrupted run's batches: {same}")


if __name__ == "__main__":
    main()
