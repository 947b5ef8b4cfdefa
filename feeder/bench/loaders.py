"""The loaders under comparison, built the same way for every benchmark.

All of them read the same ImageFolder, apply RandomResizedCrop(224) and a
horizontal flip, and deliver uint8 batches of the same size:

* ``dl-pil``: ``torch.utils.data.DataLoader`` over a Dataset doing what a
  torchvision user's default pipeline does per sample (PIL open, convert RGB,
  ``RandomResizedCrop`` with torchvision's parameters and PIL bilinear resize of
  the crop box, flip, ``PILToTensor``), written here without torchvision.
* ``dl-cv2``: DataLoader over a Dataset doing exactly the feeder's per-sample
  work: ``feeder.decode.step.SampleWork``, the object the engine's own steps call
  (the same reduced-scale decode, the same compiled transform chain writing into
  a preallocated array). Comparing it with the feeder isolates the engine from
  the decoder.
* ``feeder``: :class:`feeder.Feeder` itself.

DataLoader settings are the fair ones for a CPU run: ``pin_memory=False`` on CPU,
default collate, the worker count chosen by the benchmark from a grid, and
``persistent_workers=True`` when a run has several epochs (its fastest setting:
workers are not started again each epoch), ``False`` (the default) for one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from .. import Feeder, FileList, ImageFolder, ops
from ..ops.fused import ResizeCenterCrop
from ..ops.chain import Chain
from ..sample import DEFAULT_MAX_PIXELS
from ..engine.steps import SampleWork
from ..sample.rng import sample_key

CROP = 224  # RandomResizedCrop output side, as in ImageNet training

LOADER_KINDS = ("dl-pil", "dl-cv2", "feeder")


def transforms(size: int = CROP) -> list[ops.Transform]:
    """The transform list every loader applies (feeder's ops): RandomResizedCrop to
    ``size`` pixels a side, then a horizontal flip."""
    return [ops.RandomResizedCrop(size), ops.RandomHorizontalFlip()]


def image_source(root: str, limit: int | None = None) -> ImageFolder | FileList:
    """The ImageFolder at ``root``, or ``limit`` of its images spread evenly over it
    (every class; the same images for every loader) when it holds more."""
    folder = ImageFolder(root)
    if limit is None or limit >= len(folder):
        return folder
    picks = np.linspace(0, len(folder) - 1, limit).astype(int).tolist()
    return FileList([folder.paths[i] for i in picks], [int(folder.labels[i]) for i in picks])


class _FullDecodeCrop(ops.RandomResizedCrop):
    """RandomResizedCrop that gives the decoder no size hint: JPEGs decode at full size.

    ``Chain`` only asks a transform for a hint when its class overrides
    ``Transform.decode_hint``; restoring the base method turns the hint off while
    the chain, its random streams (keyed by position) and the crop box stay the
    same. (Prepending an identity callable also disables the hint, but shifts
    every transform's stream index, so the crops would differ.) ``decode_box`` is
    restored too, so that the region decoder is not used either: the whole image
    is decoded, then cropped.
    """

    decode_hint = ops.Transform.decode_hint
    decode_box = ops.Transform.decode_box


class _FullDecodeResizeCenterCrop(ResizeCenterCrop):
    """The fused Resize + CenterCrop with no hint and no box: the whole image is decoded."""

    decode_hint = ops.Transform.decode_hint
    decode_box = ops.Transform.decode_box


EVAL_RESIZE = 256


def eval_transforms(full_decode: bool = False) -> list[ops.Transform]:
    """The evaluation transform, Resize(256) + CenterCrop(224) (fused by the chain);
    ``full_decode``: the same step decoding whole images at full size."""
    if full_decode:
        return [_FullDecodeResizeCenterCrop(ops.Resize(EVAL_RESIZE), ops.CenterCrop(CROP))]
    return [ops.Resize(EVAL_RESIZE), ops.CenterCrop(CROP)]


def full_decode_transforms() -> list[ops.Transform]:
    """:func:`transforms` with reduced-scale JPEG decode switched off: same crops, full decode."""
    return [_FullDecodeCrop(CROP), ops.RandomHorizontalFlip()]


def has_pil() -> bool:
    """Whether Pillow is importable (the ``dl-pil`` baseline needs it)."""
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        return False
    return True


class PILDataset(torch.utils.data.Dataset):
    """The per-sample work of torchvision's ``ImageFolder`` + ``RandomResizedCrop(224)``
    + ``RandomHorizontalFlip()`` + ``PILToTensor()``, without torchvision.

    Random numbers come from torch's generator, as torchvision's transforms draw
    them (DataLoader seeds each worker's generator differently).

    Args:
        root: ImageFolder root.
        size: Crop output side in pixels.
        scale, ratio: RandomResizedCrop's area and aspect ranges.
    """

    def __init__(self, root: str, size: int = CROP, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        folder = ImageFolder(root)
        self.paths = folder.paths
        self.labels = folder.labels
        self.size = size
        self.scale = scale
        self.ratio = ratio

    def __len__(self) -> int:
        return len(self.paths)

    def _params(self, height: int, width: int) -> tuple[int, int, int, int]:
        # torchvision.transforms.RandomResizedCrop.get_params, line for line.
        area = height * width
        log_ratio = torch.log(torch.tensor(self.ratio))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(self.scale[0], self.scale[1]).item()
            aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,)).item()
                j = torch.randint(0, width - w + 1, size=(1,)).item()
                return i, j, h, w
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h, w = height, int(round(height * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with open(self.paths[index], "rb") as f:  # torchvision's pil_loader
            img = Image.open(f)
            img = img.convert("RGB")
        width, height = img.size
        i, j, h, w = self._params(height, width)
        # F.resized_crop on a PIL image is crop + resize(BILINEAR); resizing the
        # crop box directly gives the same pixels and skips the crop's copy.
        img = img.resize((self.size, self.size), Image.BILINEAR, box=(j, i, j + w, i + h))
        if torch.rand(1) < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        # PILToTensor: a CHW view of an HWC copy; default_collate stacks it.
        return torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1), self.labels[index]


def sample_work(transform_list: list[Any] | None = None,
                max_pixels: int = DEFAULT_MAX_PIXELS, files: int | None = None) -> SampleWork:
    """The feeder's own per-sample work (``feeder.decode.step.SampleWork``, the very object
    the engine's decode and augment steps call), for ``transform_list`` (default
    :func:`transforms`); ``files``: the source's length, which sizes each JPEG's
    index as a feeder over that source sizes it."""
    return SampleWork(Chain(transform_list if transform_list is not None else transforms(), None),
                      max_pixels, files=files)


class FeederWorkDataset(torch.utils.data.Dataset):
    """The feeder's own per-sample work as a map-style Dataset.

    Reads through the same :class:`~feeder.ImageFolder`, decodes and transforms
    with :class:`SampleWork` (simplejpeg with the same reduced-scale hint and
    decode-buffer reuse, the same compiled chain) into a fresh [H, W, 3] array,
    and returns it as an HWC tensor: batches come out ``[B, H, W, 3]`` and are
    viewed as ``[B, 3, H, W]``, the feeder's layout.

    Args:
        root: ImageFolder root.
        transform_list: Transforms (default :func:`transforms`).
        seed: Base of the per-sample keys, as the feeder's ``seed``.
        limit: Only this many of the images (:func:`image_source`).
    """

    def __init__(self, root: str, transform_list: list[Any] | None = None, seed: int = 0,
                 limit: int | None = None) -> None:
        self.source = image_source(root, limit)
        self.work = sample_work(transform_list, files=len(self.source))
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.sample(index, self.epoch)

    def sample(self, index: int, epoch: int) -> tuple[torch.Tensor, int]:
        """Sample ``index`` as epoch ``epoch`` draws it (thread-safe: a loader running
        the work in threads of one process calls it from each of them)."""
        data, label = self.source.read(index)
        h, w = self.work.image_size
        # A fresh array per sample: default_collate copies it into the batch
        # (DataLoader has no way to write into the batch in place).
        out = np.empty((h, w, 3), np.uint8)
        self.work(data, sample_key(self.seed, epoch, index), out)
        return torch.from_numpy(out), label


def _limit_cv2_threads(worker_id: int) -> None:
    # Each worker process is one of num_workers; OpenCV fanning out over every
    # core inside each of them would oversubscribe the machine (the feeder
    # limits OpenCV to one thread for the same reason).
    import cv2

    cv2.setNumThreads(1)


class _WorkerInit:
    """``worker_init_fn`` for the ``dl-cv2`` workers: OpenCV on one thread, then ``then``."""

    def __init__(self, then: Callable[[int], None] | None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        _limit_cv2_threads(worker_id)
        if self.then is not None:
            self.then(worker_id)


class Loader:
    """One configured loader: iterate it for one epoch with :meth:`epoch`.

    Args:
        kind: ``"dl-pil"``, ``"dl-cv2"`` or ``"feeder"``.
        root: ImageFolder root.
        batch_size: Samples per batch.
        workers: DataLoader ``num_workers`` (DataLoader kinds).
        decode_threads, augment_threads, queue_size: Feeder settings (``"auto"`` allowed).
        device: ``"cpu"`` or ``"cuda"``; DataLoader pins memory and copies
            non-blocking on CUDA, as its documentation advises.
        full_decode: Feeder only: switch reduced-scale JPEG decode off.
        seed: Shuffle and augmentation seed.
        persistent_workers: DataLoader only: keep workers across epochs (then the
            dataset's epoch attribute no longer reaches them: same speed, other crops).
        feeder_options: Feeder only: more keyword arguments of :class:`~feeder.Feeder`.
        worker_init_fn: DataLoader only: run in each worker after OpenCV is limited
            to one thread (``dl-cv2``), or as the only initializer (``dl-pil``).
        starting: A context manager factory entered around each ``iter()`` of the
            underlying loader and, for a feeder, its first ``next()``: where a pass
            starts its threads or DataLoader its workers (the interference benchmark
            pins them to the loader's cores there).
        evaluation: Feeder and ``dl-cv2``: the evaluation transform
            (:func:`eval_transforms`) instead of RandomResizedCrop + flip.
        size: Feeder and ``dl-cv2``: RandomResizedCrop's output side (default 224).
        limit: Feeder and ``dl-cv2``: only this many images of ``root``
            (:func:`image_source`).
    """

    def __init__(self, kind: str, root: str, batch_size: int, *, workers: int = 0,
                 decode_threads: int | str = "auto", augment_threads: int | str = "auto",
                 queue_size: int = 4, device: str = "cpu", full_decode: bool = False,
                 seed: int = 0, persistent_workers: bool = False,
                 feeder_options: dict[str, Any] | None = None,
                 worker_init_fn: Callable[[int], None] | None = None,
                 starting: Callable[[], Any] = contextlib.nullcontext, evaluation: bool = False,
                 size: int = CROP, limit: int | None = None) -> None:
        if kind not in LOADER_KINDS:
            raise ValueError(f"loader kind must be one of {LOADER_KINDS}, got {kind!r}")
        if kind == "dl-pil" and (size != CROP or limit is not None):
            raise ValueError("the dl-pil loader crops to 224 over the whole folder: no size or limit")
        self.kind = kind
        self.device = torch.device(device)
        self._to_device = self.device.type == "cuda" and kind != "feeder"
        self.feeder: Feeder | None = None
        self._starting = starting
        if kind == "feeder":
            chain = (eval_transforms(full_decode) if evaluation
                     else full_decode_transforms() if full_decode else transforms(size))
            self.feeder = Feeder(image_source(root, limit), batch_size, chain,
                                 decode_threads=decode_threads, augment_threads=augment_threads,
                                 queue_size=queue_size, device=device, shuffle=True, seed=seed,
                                 **(feeder_options or {}))
            self.loader: Iterable[Any] = self.feeder
            return
        dataset = (PILDataset(root) if kind == "dl-pil" else
                   FeederWorkDataset(root, eval_transforms() if evaluation else transforms(size),
                                     seed=seed, limit=limit))
        self.dataset = dataset
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
            pin_memory=self.device.type == "cuda", drop_last=False,
            persistent_workers=persistent_workers and workers > 0,
            generator=generator,
            worker_init_fn=(None if workers == 0 else _WorkerInit(worker_init_fn) if kind == "dl-cv2"
                            else worker_init_fn))

    def epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield the batches of one epoch as ``([B, 3, H, W] uint8, [B] int64)`` on the device."""
        if self.feeder is not None:
            self.feeder.set_epoch(epoch)
            with self._starting():
                # A pass starts its threads at its first next(), not at iter().
                it = iter(self.feeder)
                first = next(it, None)
            if first is not None:
                yield first
                # The loop has the first batch now: holding it here too would keep
                # its buffer from coming back for the whole epoch (a third buffer
                # allocated, 9 MiB at 224 px, that no training loop holds).
                first = None
                yield from it
            return
        if isinstance(self.dataset, FeederWorkDataset):
            # Workers fork at iter() with persistent_workers=False, so they see it.
            self.dataset.epoch = epoch
        hwc = self.kind == "dl-cv2"
        with self._starting():
            it = iter(self.loader)
        for images, labels in it:
            if hwc:
                images = images.permute(0, 3, 1, 2)  # the feeder's channels_last layout, no copy
            if self._to_device:
                images = images.to(self.device, non_blocking=True)
                labels = labels.to(self.device, non_blocking=True)
            yield images, labels

    def stats(self) -> dict[str, Any]:
        """The feeder's stats as plain numbers (empty for DataLoader)."""
        if self.feeder is None:
            return {}
        s = self.feeder.stats()
        return {"consumer_wait_s": s.consumer_wait_s, "elapsed_s": s.elapsed_s,
                "bottleneck": s.bottleneck, "buffers": s.buffers, "memory": dict(vars(s.memory)),
                "decode_threads": self.feeder.config.decode_threads,
                "augment_threads": self.feeder.config.augment_threads,
                "stages": {st.name: {"busy_s": st.busy_s, "wait_input_s": st.wait_input_s,
                                     "wait_output_s": st.wait_output_s, "items": st.items}
                           for st in s.stages}}

    def close(self) -> None:
        """Stop the feeder's threads (DataLoader's workers stop at the end of each epoch)."""
        if self.feeder is not None:
            self.feeder.close()
