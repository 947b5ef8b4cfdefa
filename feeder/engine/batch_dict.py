"""The public :class:`Batch`: the dict of named fields ``next()`` returns for
samples with fields, registered with torch's pytree, and its
:meth:`~Batch.images_and_targets` for torchvision's detection and segmentation
models.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Batch"]


class Batch(dict):
    """A batch of named fields: a ``dict`` (``"image"``, ``"label"``, ``"mask"``,
    ``"boxes"``...) that cannot be silently unpacked as a pair.

    ``images, targets = batch`` (or ``for images, targets in feeder``) on a
    plain dict of two fields binds the two *key names*, and the mistake
    surfaces much later (in the loss, or never). A two-field ``Batch`` raises
    a ``TypeError`` that says what to write instead when iterated directly;
    with more fields, unpacking into two names fails anyway (Python's "too
    many values to unpack"), so iterating gives the keys as a dict does. Take
    fields by name, or iterate ``batch.keys()``, ``batch.values()`` or
    ``batch.items()``, which work for any batch. Everything else is a dict's:
    ``dict(batch)``, ``{**batch}``, ``len``, ``in``, pickling, torch's pytree,
    and the trainers' device moves (which rebuild mappings from ``items()``).
    """

    # {field: (its tensor, its rows as host values)}: a variable-size batch's
    # "size" rows as (height, width) pairs, and each per-image integer field's
    # values, as the transfer stage had them on the host, so that
    # images_and_targets() does not read them back from the device (a wait for
    # the device every step). Keyed by the tensor: a field a batch transform
    # replaced is read from its new tensor.
    __slots__ = ("_host",)

    def images_and_targets(self, rename: dict[str, str] | None = None
                           ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        """The batch as torchvision's detection and segmentation models take it: a
        list of ``[3, h, w]`` images, each at its own size (views of the batch:
        ``"size"`` says how much of a padded batch is the image), and a list of
        one dict per image holding its other fields (boxes, per-box fields,
        labels, a mask cut to the image's size, per-instance ``"masks"`` uint8
        ``[N, h, w]`` cut to it too, ``"keypoints"`` ``[N, K, 3]``,
        passed-through values), as Mask R-CNN and Keypoint R-CNN take them.

        A per-image integer field (one number per image, such as ``"image_id"``)
        comes as a Python ``int``, as torchvision's detection references and
        pycocotools' ``loadRes`` take ``target["image_id"]``.

        Args:
            rename: Field names to give other keys in the targets, e.g.
                ``{"box_labels": "labels"}`` for torchvision's detection models. A
                key and value ending in ``*`` rename a prefix: ``{"box_*": "*"}``
                gives ``box_labels``, ``box_area`` and ``box_iscrowd`` as
                ``labels``, ``area`` and ``iscrowd``. A field's own name wins over
                a prefix, and a longer prefix over a shorter one.

        Raises:
            ValueError: ``rename`` names a field (or a prefix) the batch does not
                have, writes ``*`` elsewhere than at the end of both a key and its
                value, or gives a field the name of another target (of a field
                already called so, or of another renamed field): one would
                silently replace the other.
        """
        images = self["image"]
        n = images.shape[0]
        size = dict.get(self, "size")
        if size is None:
            sizes = [tuple(images.shape[-2:])] * n
        else:
            sizes = self._host_values("size", size)
        out = [img[:, :h, :w] for img, (h, w) in zip(images, sizes)]
        kept = [name for name in dict.keys(self) if name not in ("image", "size")]
        names = _renamed(kept, rename or {})
        claimed: dict[str, str] = {}
        for name in kept:
            key = names[name]
            if key in claimed:
                raise ValueError(f"images_and_targets: with rename={rename!r}, the fields "
                                 f"{claimed[key]!r} and {name!r} would both be {key!r} in the "
                                 f"targets, and one would replace the other; choose another name, "
                                 f"or rename the other field too")
            claimed[key] = name
        targets: list[dict[str, Any]] = [{} for _ in range(n)]
        for name, value in dict.items(self):
            if name in ("image", "size"):
                continue
            key = names[name]
            if _per_image_integer(value, n):
                for k, number in enumerate(self._host_values(name, value)):
                    targets[k][key] = number
                continue
            for k in range(n):
                item = value[k]
                if name == "mask":
                    h, w = sizes[k]
                    item = item[:h, :w]  # of a padded batch: the image's part
                elif name == "masks" and isinstance(item, torch.Tensor) and item.dim() == 3:
                    h, w = sizes[k]
                    item = item[:, :h, :w]  # per-instance masks: the image's part
                targets[k][key] = item
        return out, targets

    def _host_values(self, name: str, value: torch.Tensor) -> list[Any]:
        """``value.tolist()``, from the host copy the transfer stage kept if it has one."""
        entry = getattr(self, "_host", {}).get(name)
        if entry is not None and entry[0] is value:
            return entry[1]
        return value.tolist()

    def __iter__(self) -> Iterator[str]:
        if len(self) == 2:
            a, b = self.keys()
            raise TypeError(
                f"a feeder batch of named fields is a dict: `x, y = batch` would bind its key names "
                f"({a!r}, {b!r}), so it is not iterated directly; take the fields by name, "
                f"batch[{a!r}], batch[{b!r}], or iterate batch.keys() / batch.items()")
        return super().__iter__()


def _per_image_integer(value: Any, n: int) -> bool:
    """Whether a batch field holds one integer per image (an id, a class), which the
    targets give as Python ints."""
    return (isinstance(value, torch.Tensor) and value.shape == (n,)
            and not value.dtype.is_floating_point and not value.dtype.is_complex
            and value.dtype != torch.bool)


def _renamed(kept: list[str], rename: dict[str, str]) -> dict[str, str]:
    """Each field's name in the targets under ``rename`` (see
    :meth:`Batch.images_and_targets`)."""
    exact: dict[str, str] = {}
    prefixes: dict[str, str] = {}
    for old, new in rename.items():
        if not isinstance(old, str) or not isinstance(new, str):
            raise ValueError(f"images_and_targets: rename maps names to names, got "
                             f"{old!r}: {new!r}")
        stars = (old.count("*"), new.count("*"))
        if stars == (0, 0):
            exact[old] = new
        elif stars == (1, 1) and old.endswith("*") and new.endswith("*"):
            prefixes[old[:-1]] = new[:-1]
        else:
            raise ValueError(f"images_and_targets: rename {old!r}: {new!r}; a prefix is "
                             f"renamed with one '*' at the end of both, as "
                             f"{{'box_*': '*'}} (box_area -> area)")
    names = {}
    used = set()
    for name in kept:
        if name in exact:
            names[name] = exact[name]
            used.add(name)
            continue
        matches = [p for p in prefixes if name.startswith(p)]
        if matches:
            prefix = max(matches, key=len)
            names[name] = prefixes[prefix] + name[len(prefix):]
            used.add(prefix + "*")
        else:
            names[name] = name
    missing = sorted(set(exact) - used) + sorted(p + "*" for p in prefixes if p + "*" not in used)
    if missing:
        raise ValueError(f"images_and_targets: rename names the field(s) {missing}, which the "
                         f"targets do not have (their fields: {kept})")
    return names


def _register_batch_with_pytree() -> None:
    # torch's pytree (tree_map, torch.compile's input handling) treats an
    # unregistered dict subclass as a leaf; flatten a Batch like a dict.
    try:
        from torch.utils import _pytree
    except ImportError:  # pragma: no cover - every supported torch has it
        return
    def flatten(batch: Batch) -> tuple[list[Any], list[str]]:
        keys = list(batch.keys())
        return [batch[k] for k in keys], keys

    def unflatten(values: Any, keys: Any) -> Batch:
        return Batch(zip(keys, values))

    register = getattr(_pytree, "register_pytree_node", None)
    if register is not None:
        try:
            register(Batch, flatten, unflatten, serialized_type_name="feeder.Batch")
        except (TypeError, ValueError):  # an older signature, or registered already
            pass


_register_batch_with_pytree()
