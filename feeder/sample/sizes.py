"""The sizes of a feeder's images: every image one size (``image_size``, or the
transforms' own), or sizes that vary up to ``max_image_size``, each batch padded
(:class:`Padding`). Whether sizes vary is decided once, with the configuration:
:attr:`SizeOptions.padding` is a :class:`Padding` or None, and every stage that
treats variable sizes apart reads it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Padding:
    """How variable-size batches are padded (``Feeder(max_image_size=...)``): each
    batch's extent is its largest image's sides rounded up to a multiple of
    ``divisibility``; padded mask pixels hold ``mask_fill``."""

    divisibility: int = 1
    mask_fill: int = 255


@dataclasses.dataclass(frozen=True)
class SizeOptions:
    """The feeder options that decide the images' sizes (see ``Feeder``'s arguments
    of the same names). ``padding``: decided from them, not an option: a
    :class:`Padding` when sizes vary (``max_image_size`` given), else None."""

    image_size: tuple[int, int] | None = None
    max_image_size: tuple[int, int] | str | None = None
    size_divisibility: int = 1
    mask_fill: int = 255
    padding: Padding | None = dataclasses.field(init=False, compare=False,
                                                metadata={"derived": "max_image_size"})

    def __post_init__(self) -> None:
        # Variable sizes, decided here once ("auto" too: resolved to a bound later).
        padding = (Padding(self.size_divisibility, self.mask_fill)
                   if self.max_image_size is not None else None)
        object.__setattr__(self, "padding", padding)
