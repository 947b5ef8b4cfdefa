"""Page-locked host memory that the feeder owns: registered with
``cudaHostRegister`` at exactly the size it needs, and unregistered only once
no copy can read it.

Two users: the batch pool of the thread engine allocates its buffers here
(:meth:`PinnedHost.empty`), and the isolated engine page-locks the worker's
shared arrays in place (:meth:`PinnedHost.register`).

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator
rounds every block up to a power of two (a 38.5 MB batch buffer locks 64 MiB),
keeps freed blocks for the whole process, and gives them back only through
``empty_host_cache()``, which empties every other user's cached blocks too.
Here each block is one anonymous mapping of the array's bytes rounded to the
page, locked as it is, and unlocked by its owner after the side stream has
drained (:meth:`PinnedHost.unregister_all`).

The ledger holds a reference to every registered array: memory that is still
registered is never unmapped, even when its other users are gone or a teardown
could not drain the side stream (the registration is then kept).
(test_pinned_blocks_are_exactly_the_buffer_bytes,
test_isolated_close_that_times_out_keeps_the_mirrors_registered.)
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

# cudaHostRegisterPortable: the registration holds in every CUDA context.
HOST_REGISTER_PORTABLE = 1
PAGE = mmap.PAGESIZE


def page_round(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (what a block of that size locks)."""
    return -(-nbytes // PAGE) * PAGE


class PinnedHost:
    """A ledger of host memory page-locked with ``cudaHostRegister``.

    Args:
        device: The CUDA device made current for every register and unregister
            call (they need a context, and the calling thread's own device may be
            GPU 0, a context there in every torchrun rank); None: the calling
            thread's. Set per pass with :attr:`device`.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self._lock = threading.Lock()
        # address -> (bytes locked, the array that keeps the memory mapped)
        self._blocks: dict[int, tuple[int, Any]] = {}
        self._warned = False

    @property
    def locked_bytes(self) -> int:
        """Bytes page-locked now."""
        return sum(size for size, _ in list(self._blocks.values()))

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        if self.device is None:
            yield
            return
        with torch.cuda.device(self.device):
            yield

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized host tensor in a block of its own, page-locked at its
        size rounded to the page (pageable, with a warning, where the driver
        refuses to lock it: copies from it are then synchronous)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        # An anonymous mapping: page-aligned, as cudaHostRegister wants it, and
        # returned to the system when its last view is gone.
        block = mmap.mmap(-1, max(page_round(nbytes), PAGE))
        array = np.frombuffer(block, dtype=np.uint8, count=nbytes)
        tensor = torch.from_numpy(array).view(dtype).view(shape) if nbytes else torch.empty(
            shape, dtype=dtype)
        if nbytes:
            self.register(tensor, page_round(nbytes))
        return tensor

    def register(self, tensor: torch.Tensor, nbytes: int | None = None) -> bool:
        """Page-lock ``tensor``'s memory in place (``nbytes`` from its start; default
        its own bytes) and keep a reference to it until :meth:`unregister_all`.

        Returns:
            False when the driver refused (logged once): the memory stays pageable.
        """
        ptr = tensor.data_ptr()
        size = tensor.numel() * tensor.element_size() if nbytes is None else nbytes
        if size == 0:
            return True
        with self._current():
            code = torch.cuda.cudart().cudaHostRegister(ptr, size, HOST_REGISTER_PORTABLE)
        if int(code) != 0:
            if not self._warned:
                self._warned = True
                log.warning("cudaHostRegister of %d bytes of batch memory failed (%s): copies "
                            "from it will not overlap the training step", size, code)
            return False
        with self._lock:
            self._blocks[ptr] = (size, tensor)
        return True

    def unregister_all(self) -> None:
        """Unlock every block and drop the ledger's references (a block's memory is
        returned when its last view is gone). Call only once no copy can read them:
        after the side stream has drained. Safe to repeat."""
        with self._lock:
            blocks, self._blocks = self._blocks, {}
        if not blocks:
            return
        cudart = torch.cuda.cudart()
        with self._current():
            for ptr in blocks:
                cudart.cudaHostUnregister(ptr)

    def forget(self) -> None:
        """In a forked child: the page locks are the parent's (a child does not
        inherit them), so there is nothing to unlock here."""
        self._lock = threading.Lock()  # a parent's thread may have held it
        self._blocks = {}
