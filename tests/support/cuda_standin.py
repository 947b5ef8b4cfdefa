"""A CUDA stand-in for machines without a GPU: ``torch.cuda`` replaced by a
recording fake, and "CUDA" tensors that live in CPU memory.

``tests/cuda`` runs under it in CI (``tests/conftest.py``'s ``cuda`` fixture installs it for
every test when ``torch.cuda.is_available()`` is False; on a GPU the tests run
on the device). ``tests/engine/test_cuda_logic.py`` uses it directly.

What it models, and what it cannot:

* Devices: ``count`` of them, a current device per thread (``set_device``, the
  ``torch.cuda.device`` context), and the devices that got a context (``contexts``:
  a stream, pinned memory, a copy, an event or a kernel there), so a test can
  assert that nothing touched GPU 0.
* Streams and events: made, recorded, waited on and synchronized, each call in
  ``calls`` (a :class:`Call`, with the thread, the current device and stream).
  Work runs at once on the CPU, so a missing wait never shows as a wrong value:
  tests assert the order of the recorded calls instead.
* Tensors: ``.to("cuda")``, ``.cuda()`` and factories with a CUDA ``device``
  give a :class:`DeviceTensor` (CPU memory, ``is_cuda`` True, its ``device`` the
  CUDA one) that ops carry along; ``.cpu()`` and ``.numpy()`` behave as on a
  GPU (a copy; ``numpy()`` refuses), and so does an op mixing a device tensor
  with a CPU tensor of one dimension or more. Pinned memory is remembered by
  address (``pin_memory=True``, ``cudaHostRegister``): ``is_pinned()`` answers
  from it, and every host-to-device copy records whether its source was pinned.
* Synchronizing calls (``item()``, ``tolist()``, a copy to the host,
  ``torch.cuda.synchronize()``) are recorded, and warned about or refused under
  ``torch.cuda.set_sync_debug_mode``, as on a GPU.

It cannot show a race: timing, the copy engine and the caching allocator are
the real device's. Those checks are marked ``real_cuda`` in ``tests/cuda`` and
run by ``scripts/gpu-check`` on a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree

#: Whether this process has a real CUDA device (read before any stand-in is installed).
REAL_CUDA = torch.cuda.is_available()

_ACTIVE: "Standin | None" = None  # the installed stand-in (one at a time)
_MIXED_DEVICE_OPS = {"equal", "allclose", "cat", "stack", "add", "sub", "mul", "div", "where",
                     "eq", "ne", "__add__", "__sub__", "__mul__", "__truediv__", "__eq__",
                     "__ne__", "__or__", "__and__", "__radd__", "__rmul__", "__rsub__"}
_SYNCING = {"item", "tolist", "nonzero", "__bool__", "__int__", "__float__"}
_NO_WRAP = {"__repr__", "__format__", "__str__", "data_ptr", "untyped_storage", "storage"}


@dataclass
class Call:
    """One recorded CUDA call: what, in which thread, with which device and stream
    current (the stream's ``cuda_stream`` number), and its particulars."""

    what: str
    thread: str
    device: int
    stream: int
    detail: dict = field(default_factory=dict)


def _index(device: Any) -> int | None:
    """The CUDA index ``device`` names (None for another kind; -1: "cuda" unindexed)."""
    if isinstance(device, int):
        return device
    if isinstance(device, (str, torch.device)):
        dev = torch.device(device)
        if dev.type == "cuda":
            return -1 if dev.index is None else dev.index
    return None


class DeviceTensor(torch.Tensor):
    """A tensor that is on a CUDA device as far as the code under test can tell,
    and in CPU memory in fact."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self.__dict__.get("_standin_index", 0))

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:  # type: ignore[override]
        return self.__dict__.get("_standin_index", 0)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        standin = _ACTIVE
        index = next((t.__dict__.get("_standin_index", 0) for t in _pytree.tree_leaves((args, kwargs))
                      if isinstance(t, DeviceTensor)), 0)
        name = getattr(func, "__name__", "")
        if name == "numpy":
            raise TypeError(f"can't convert cuda:{index} device type tensor to numpy. Use "
                            "Tensor.cpu() to copy the tensor to host memory first.")
        if name in _MIXED_DEVICE_OPS:
            for leaf in _pytree.tree_leaves((args, kwargs)):
                if (isinstance(leaf, torch.Tensor) and not isinstance(leaf, DeviceTensor)
                        and leaf.dim() > 0):
                    raise RuntimeError("Expected all tensors to be on the same device, but found "
                                       f"at least two devices, cuda:{index} and cpu! ({name})")
        if _index(kwargs.get("device")) is not None:
            kwargs["device"] = "cpu"
        if standin is not None:
            if name in _SYNCING:
                standin.synchronizing(name)
            elif name not in _NO_WRAP and not name.startswith("__get"):
                standin.touch(index)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if name in _NO_WRAP:
            return out
        return _pytree.tree_map(lambda v: _on_device(v, index) if isinstance(v, torch.Tensor) else v,
                                out)


def _on_device(tensor: torch.Tensor, index: int) -> DeviceTensor:
    if isinstance(tensor, DeviceTensor):
        return tensor
    with torch._C.DisableTorchFunctionSubclass():
        out = tensor.as_subclass(DeviceTensor)
    out.__dict__["_standin_index"] = index
    return out


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.as_subclass(torch.Tensor) if isinstance(tensor, DeviceTensor) else tensor


class Standin:
    """``torch.cuda`` on the CPU, every call recorded.

    Args:
        current: Every thread's current device until it sets one.
        count: How many devices there are.

    ``log`` keeps short tuples for the transfer path's CUDA calls (``("stream",
    index, priority, current)``, ``("event", blocking)``, ``("record", index)``,
    ``("sync", blocking, current)``, ``("spin", index)``, ``("register", ptr,
    current)``, ``("unregister", ptr, current)``, ``("empty host cache",
    current)``); ``calls`` every call in full (see :class:`Call`).
    """

    def __init__(self, current: int = 0, count: int = 2) -> None:
        self.log: list[tuple] = []
        self.calls: list[Call] = []
        self.count = count
        self.default = current
        self.local = threading.local()
        self.contexts: set[int] = set()
        self.initialized = False
        self.sync_mode = 0
        self.pinned: dict[int, tuple[int, Any]] = {}  # address -> (bytes, the owner kept alive)
        self.locked: dict[int, int] = {}  # address -> bytes cudaHostRegister'ed now
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._defaults: dict[int, Any] = {}
        fake = self

        class Event:
            def __init__(self, enable_timing=False, blocking=False, interprocess=False):
                self.blocking = blocking
                self.id = next(fake._ids)
                self.stream: Any = None  # where it was last recorded
                fake.log.append(("event", blocking))

            def record(self, stream=None):
                stream = stream if stream is not None else fake.current_stream()
                self.stream = stream
                fake.log.append(("record", stream.index))
                fake.call("record", stream=stream, event=self.id)
                fake.touch(stream.index)

            def synchronize(self):
                fake.log.append(("sync", self.blocking, fake.current()))
                fake.call("event sync", event=self.id, blocking=self.blocking)

            def query(self):
                return True

            def wait(self, stream=None):
                (stream if stream is not None else fake.current_stream()).wait_event(self)

            def elapsed_time(self, other):
                return 0.0

        class Stream:
            def __init__(self, device=None, priority=0, **_):
                index = _index(device)
                self.index = fake.current() if index is None or index < 0 else index
                self.device = torch.device("cuda", self.index)
                self.priority = priority
                self.cuda_stream = next(fake._ids)
                if not _:
                    fake.log.append(("stream", self.index, priority, fake.current()))
                    fake.call("stream", stream=self, priority=priority)
                    fake.touch(self.index)

            @staticmethod
            def priority_range():
                return (0, -5)

            def synchronize(self):
                fake.log.append(("spin", self.index))
                fake.call("stream sync", stream=self)

            def query(self):
                return True

            def wait_event(self, event):
                fake.call("wait", stream=self, event=event.id)

            def wait_stream(self, stream):
                fake.call("wait stream", stream=self, other=stream.cuda_stream)

            def record_event(self, event=None):
                event = event or Event()
                event.record(self)
                return event

            def __repr__(self):
                return f"<stand-in stream {self.cuda_stream} on cuda:{self.index}>"

        class Cudart:
            def cudaHostRegister(self, ptr, size, flags):
                fake.log.append(("register", ptr, fake.current()))
                fake.call("register", ptr=ptr, size=size)
                fake.touch(fake.current())
                fake.pinned[ptr] = (size, None)
                fake.locked[ptr] = size
                return 0

            def cudaHostUnregister(self, ptr):
                fake.log.append(("unregister", ptr, fake.current()))
                fake.call("unregister", ptr=ptr)
                fake.pinned.pop(ptr, None)
                fake.locked.pop(ptr)  # unregistering what is not registered is a bug
                return 0

        class Generator(torch.Generator):
            """A CPU generator that says it is on the device it was made for."""

            def __new__(cls, device="cpu"):
                return super().__new__(cls, "cpu")

            def __init__(self, device="cpu"):
                index = _index(device)
                self._device = (torch.device("cpu") if index is None else
                                torch.device("cuda", fake.current() if index < 0 else index))
                if index is not None:
                    fake.touch(self._device.index)

            @property
            def device(self):
                return self._device

        self.Event, self.Stream, self.cudart, self.Generator = Event, Stream, Cudart(), Generator

    # -- state --------------------------------------------------------------------
    def current(self) -> int:
        """The calling thread's current device."""
        return getattr(self.local, "device", self.default)

    def set_current(self, index: int) -> None:
        """``torch.cuda.set_device`` in the calling thread."""
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        self.local.device = index
        self.initialized = True

    @contextlib.contextmanager
    def device(self, device):
        index = _index(device)
        before = self.current()
        if index is not None and index >= 0:
            self.local.device = index
        try:
            yield
        finally:
            self.local.device = before

    def default_stream(self, device=None) -> Any:
        index = self._resolve(device)
        with self._lock:
            if index not in self._defaults:
                stream = self.Stream(index, quiet=True)
                stream.cuda_stream = 0 if index == 0 else -index  # as CUDA's legacy default
                self._defaults[index] = stream
            return self._defaults[index]

    def current_stream(self, device=None) -> Any:
        index = self._resolve(device)
        stack = getattr(self.local, "streams", {}).get(index)
        return stack[-1] if stack else self.default_stream(index)

    @contextlib.contextmanager
    def stream(self, stream):
        if stream is None:
            yield
            return
        streams = self.local.__dict__.setdefault("streams", {})
        with self.device(stream.index):
            streams.setdefault(stream.index, []).append(stream)
            try:
                yield
            finally:
                streams[stream.index].pop()

    def _resolve(self, device) -> int:
        index = _index(device) if device is not None else None
        return self.current() if index is None or index < 0 else index

    def touch(self, index: int) -> None:
        """Work on device ``index``: CUDA is initialized and it has a context."""
        self.initialized = True
        self.contexts.add(index)

    def call(self, what: str, stream: Any = None, **detail: Any) -> None:
        stream = stream if stream is not None else self.current_stream()
        self.calls.append(Call(what, threading.current_thread().name, self.current(),
                               stream.cuda_stream, detail))

    def synchronizing(self, what: str) -> None:
        """A call that makes the host wait for the device (see ``set_sync_debug_mode``)."""
        self.call("synchronizing", op=what)
        if self.sync_mode == 1:
            warnings.warn(f"called a synchronizing CUDA operation ({what})", UserWarning,
                          stacklevel=3)
        elif self.sync_mode == 2:
            raise RuntimeError(f"called a synchronizing CUDA operation ({what})")

    def set_sync_debug_mode(self, mode) -> None:
        self.sync_mode = {"default": 0, "warn": 1, "error": 2}.get(mode, mode)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, DeviceTensor):
            return False
        ptr = tensor.data_ptr()
        return any(base <= ptr < base + size for base, (size, _) in list(self.pinned.items()))

    def _pin(self, tensor: torch.Tensor) -> torch.Tensor:
        # Held until uninstalled, so that no later allocation reuses the address.
        self.pinned[tensor.data_ptr()] = (tensor.numel() * tensor.element_size(), tensor)
        self.call("pin", bytes=tensor.numel() * tensor.element_size())
        self.touch(self.current())  # torch's host allocator: the current device's context
        return tensor

    def kinds(self, *names: str) -> list[tuple]:
        """The ``log`` entries of those kinds, in order."""
        return [entry for entry in self.log if entry[0] in names]

    def of(self, *whats: str) -> list[Call]:
        """The ``calls`` of those kinds, in order."""
        return [c for c in self.calls if c.what in whats]

    # -- tensors --------------------------------------------------------------------
    def _copy(self, tensor: torch.Tensor, index: int, non_blocking: bool) -> DeviceTensor:
        index = self.current() if index < 0 else index
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        self.call("copy to device", pinned=self.is_pinned(tensor), non_blocking=non_blocking,
                  bytes=tensor.numel() * tensor.element_size(), to=index,
                  source=tensor.data_ptr())
        self.touch(index)
        return _on_device(_plain(tensor).clone(), index)

    def _to_host(self, tensor: DeviceTensor) -> torch.Tensor:
        self.synchronizing("copy to host")
        return _plain(tensor).clone()

    def install(self, monkeypatch) -> "Standin":
        """Replace ``torch.cuda`` and the tensor calls that reach a device, until
        ``monkeypatch`` undoes them. One stand-in at a time."""
        global _ACTIVE
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(cuda, "current_device", self.current)
        monkeypatch.setattr(cuda, "set_device", lambda d: self.set_current(self._resolve(d)))
        monkeypatch.setattr(cuda, "device", self.device)
        monkeypatch.setattr(cuda, "Event", self.Event)
        monkeypatch.setattr(cuda, "Stream", self.Stream)
        monkeypatch.setattr(cuda, "stream", self.stream)
        monkeypatch.setattr(cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(cuda, "default_stream", self.default_stream)
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: self.synchronizing("synchronize"))
        monkeypatch.setattr(cuda, "_sleep", lambda cycles: self.call("sleep", cycles=cycles))
        monkeypatch.setattr(cuda, "cudart", lambda: self.cudart)
        monkeypatch.setattr(cuda, "set_sync_debug_mode", self.set_sync_debug_mode)
        monkeypatch.setattr(cuda, "get_sync_debug_mode", lambda: self.sync_mode)
        monkeypatch.setattr(cuda, "get_device_name", lambda device=None: "CUDA stand-in")
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: 0)
        monkeypatch.setattr(cuda, "memory_stats", lambda device=None: {})
        monkeypatch.setattr(cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.accelerator.memory, "empty_host_cache",
                            lambda: self.log.append(("empty host cache", self.current())))
        monkeypatch.setattr(torch, "Generator", self.Generator)
        self._patch_tensors(monkeypatch)
        monkeypatch.setattr(sys.modules[__name__], "_ACTIVE", self)
        return self

    def _patch_tensors(self, monkeypatch) -> None:
        T = torch.Tensor
        real_to, real_cpu, real_is_pinned = T.to, T.cpu, T.is_pinned
        standin = self

        def to(tensor, *args, **kwargs):
            target = kwargs.get("device")
            rest = list(args)
            if rest and (isinstance(rest[0], (str, torch.device, int)) and not isinstance(rest[0], bool)):
                target = rest.pop(0)
            elif rest and isinstance(rest[0], torch.Tensor):
                other = rest.pop(0)
                target, kwargs = other.device, dict(kwargs, dtype=other.dtype)
            kwargs.pop("device", None)
            index = _index(target)
            if index is not None:
                moved = standin._copy(tensor, index, bool(kwargs.pop("non_blocking", False)))
                kwargs.pop("copy", None)
                return moved.to(*rest, **kwargs) if rest or kwargs else moved
            if target is not None and isinstance(tensor, DeviceTensor):
                kwargs.pop("non_blocking", None)
                kwargs.pop("copy", None)
                host = standin._to_host(tensor)
                return real_to(host, *rest, **kwargs) if rest or kwargs else host
            return real_to(tensor, *args, **kwargs) if target is None else real_to(
                tensor, target, *rest, **kwargs)

        def cuda_(tensor, device=None, non_blocking=False, **_):
            index = -1 if device is None else _index(device if not isinstance(device, int) else
                                                     torch.device("cuda", device))
            return standin._copy(tensor, index, non_blocking)

        def cpu(tensor, *args, **kwargs):
            if isinstance(tensor, DeviceTensor):
                return standin._to_host(tensor)
            return real_cpu(tensor, *args, **kwargs)

        def is_pinned(tensor, *args):
            return standin.is_pinned(tensor) or (not isinstance(tensor, DeviceTensor)
                                                 and real_is_pinned(tensor))

        def pin_memory(tensor, *args):
            return standin._pin(_plain(tensor).clone())

        def record_stream(tensor, stream):
            if not isinstance(tensor, DeviceTensor):
                raise RuntimeError("record_stream of a tensor that is not on a CUDA device")
            standin.call("record_stream", stream=stream, storage=tensor.untyped_storage().data_ptr())

        for name, fn in (("to", to), ("cuda", cuda_), ("cpu", cpu), ("is_pinned", is_pinned),
                         ("pin_memory", pin_memory), ("record_stream", record_stream)):
            monkeypatch.setattr(T, name, fn)

        def factory(real):
            def make(*args, **kwargs):
                index = _index(kwargs.get("device"))
                pin = kwargs.pop("pin_memory", False)
                if index is not None:
                    kwargs["device"] = "cpu"
                    index = standin.current() if index < 0 else index
                    standin.touch(index)
                    return _on_device(real(*args, **kwargs), index)
                out = real(*args, **kwargs)
                return standin._pin(out) if pin else out
            return make

        for name in ("empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "rand",
                     "randn", "randint", "randperm", "linspace", "empty_strided", "eye"):
            monkeypatch.setattr(torch, name, factory(getattr(torch, name)))
