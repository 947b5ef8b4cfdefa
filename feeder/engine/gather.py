"""What crosses to the device besides the image: each field of a buffer's batch
gathered as delivered (:func:`_gather`), a variable-size batch's region copied
cut to its extent (:func:`copy_region`) and its padding zeroed
(:func:`zero_padding`). The reasoning is in docs/design/cuda-transfer.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .batch_dict import _per_image_integer
from .buffers import BatchBuffer
from ..sample import (BOX_LIST, INSTANCES, INT_SCALAR, LABEL, MASKS, NUMERIC, PER_BOX, POINTS,
                           Schema)

__all__ = ["copy_region", "zero_padding"]

# Variable-size batches on CUDA: below this many bytes of rows outside a batch's
# extent per sample, one copy of the whole slots beats one copy per sample (each
# copy costs a launch).
_ROWS_COPY_MIN_BYTES = 256 << 10


def copy_region(host: torch.Tensor, n: int, extent: tuple[int, int] | None,
                device: torch.device) -> torch.Tensor:
    """The first ``n`` slots of ``host`` (``[B, H, W, ...]``, pinned) on ``device``,
    cut to their top left ``extent`` (None: all of them), dense, copied on the
    current stream.

    Only the rows of the extent cross the bus when the rows left out are worth
    a copy per sample; the columns are cut on the device (a slot's rows are
    contiguous in host memory, a narrower window of them is not)."""
    if extent is None:
        return host[:n].to(device, non_blocking=True)
    hb, wb = extent
    H = host.shape[1]
    row_bytes = host[0, 0].numel() * host.element_size()
    if hb < H and (H - hb) * row_bytes >= _ROWS_COPY_MIN_BYTES:
        out = torch.empty((n, hb, *host.shape[2:]), dtype=host.dtype, device=device)
        for i in range(n):
            out[i].copy_(host[i, :hb], non_blocking=True)
    else:
        out = host[:n].to(device, non_blocking=True)[:, :hb]
    out = out[:, :, :wb]
    return out if out.is_contiguous() else out.contiguous()


def zero_padding(images: torch.Tensor, sizes: np.ndarray,
                 device_sizes: torch.Tensor | None = None) -> None:
    """Set the pixels of ``images`` (``[n, C, Hb, Wb]``) outside each image's valid
    (height, width) in ``sizes`` (host ``[n, 2]``) to 0, in place, in one pass
    over the batch. ``device_sizes``: the same sizes already on ``images``'
    device (the batch's "size" field), so that nothing is copied here."""
    Hb, Wb = images.shape[2:]
    if not len(sizes) or (sizes[:, 0] >= Hb).all() and (sizes[:, 1] >= Wb).all():
        return  # no padding in this batch
    if device_sizes is None:
        device_sizes = torch.from_numpy(np.ascontiguousarray(sizes)).to(images.device)
    h = device_sizes[:, 0].view(-1, 1, 1, 1)
    w = device_sizes[:, 1].view(-1, 1, 1, 1)
    rows = torch.arange(Hb, device=images.device).view(1, 1, Hb, 1)
    cols = torch.arange(Wb, device=images.device).view(1, 1, 1, Wb)
    images.masked_fill_((rows >= h) | (cols >= w), 0)


def _gather(buf: BatchBuffer, n: int, schema: Schema, device: torch.device,
            keep: list[torch.Tensor], extent: tuple[int, int] | None = None,
            views: list[np.ndarray] | None = None
            ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Every field of the first ``n`` slots of ``buf`` but the image, as delivered:
    tensors on ``device`` (copied there on the current stream) or lists; masks cut
    to ``extent`` (a variable-size batch's). Returns them with the device tensors
    the consumer's stream must record.

    On the CPU, every field is memory of its own, except with ``views`` (a lent
    batch's): masks may then be views of the buffer, each appended to ``views``,
    so that the buffer stays lent until they are gone too."""
    cuda = device.type == "cuda"
    fields: dict[str, Any] = {}
    extra: list[torch.Tensor] = []
    for name, spec in list(schema.specs.items()):
        kind = spec.kind
        if kind == NUMERIC:
            host = _numeric_host(buf, n, name, spec)
            value = host.to(device, non_blocking=True) if cuda else host.clone()
            extra.append(value)
        elif kind == MASKS:
            planes = buf.planes
            if cuda:
                value = copy_region(planes.low_t, n, extent, device)
                extra.append(value)
                if planes.is_wide(n):
                    high = copy_region(planes.high_t, n, extent, device)
                    extra.append(high)
                    value = value.long() | (high.long() << 8)
                    extra.append(value)
            else:
                host = planes.host(n, *(extent or (None, None)), copy=views is None)
                if views is not None and np.may_share_memory(host, planes.low):
                    views.append(host)
                value = torch.from_numpy(host)
        elif kind in (BOX_LIST, PER_BOX, POINTS, INSTANCES):
            arrays = buf.lists[name][:n]
            if kind == INSTANCES:
                # Each image's [Ni, h, w] masks, padded (with 0) to the batch's
                # images: one shape, as the images have.
                arrays = _padded(arrays, extent or tuple(buf.images.shape[1:3]))
            if cuda:
                # One pinned staging tensor and one copy for the whole batch; the
                # samples' tensors are views of its device copy.
                counts = [len(a) for a in arrays]
                trailing = arrays[0].shape[1:]
                staged = torch.empty((sum(counts), *trailing), pin_memory=True,
                                     dtype=torch.from_numpy(arrays[0][:0]).dtype)
                if staged.numel():
                    np.concatenate(arrays, out=staged.numpy())
                keep.append(staged)
                whole = staged.to(device, non_blocking=True)
                extra.append(whole)
                value = list(torch.split(whole, counts))
            else:
                value = [torch.from_numpy(np.array(a, copy=True)) for a in arrays]
        else:
            value = list(buf.lists[name][:n])
        fields[name] = value
    return fields, extra


def _padded(masks: list[np.ndarray], size: tuple[int, int]) -> list[np.ndarray]:
    """Per-instance masks ``[Ni, h, w]`` padded with 0 to ``size`` (height, width)."""
    out = []
    for m in masks:
        if m.shape[1:] != size:
            full = np.zeros((m.shape[0], *size), np.uint8)
            full[:, :m.shape[1], :m.shape[2]] = m
            m = full
        out.append(m)
    return out


def _numeric_host(buf: BatchBuffer, n: int, name: str, spec: Any) -> torch.Tensor:
    """The first ``n`` rows of a numeric field in the buffer's host memory."""
    return buf.labels_t[:n] if name == LABEL and spec == INT_SCALAR else buf.arrays[name][0][:n]


def _host_integers(buf: BatchBuffer, n: int, schema: Schema,
                   fields: dict[str, Any]) -> dict[str, tuple[torch.Tensor, list]]:
    """``{name: (its delivered tensor, its values)}`` for each per-image integer
    field, the values read from the host buffer for :meth:`Batch.images_and_targets`."""
    found = {}
    for name, spec in schema.specs.items():
        if spec.kind == NUMERIC and name in fields:
            host = _numeric_host(buf, n, name, spec)
            if _per_image_integer(host, n):
                found[name] = (fields[name], host.tolist())
    return found
