"""The child side of ``feeder-bench interference``: one training loop, alone or
fed by a loader, pinned to its cores and timed step by step (see
:mod:`feeder.bench.interference` for the benchmark and its report)."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .measure import now

log = logging.getLogger(__name__)

STEPS = ("proxy", "model")

def split_cores(cores: list[int], loop: int, loader: int) -> tuple[list[int] | None, list[int] | None]:
    """The training loop's cores and the loader's: the first ``loop`` of ``cores``
    and the next ``loader``; (None, None) when there are not enough to pin."""
    cores = sorted(cores)
    if loop < 1 or loader < 1 or len(cores) < loop + loader:
        return None, None
    return cores[:loop], cores[loop:loop + loader]


@contextlib.contextmanager
def on_cores(cores: list[int] | None) -> Iterator[None]:
    """Run the calling thread on ``cores`` inside the block (threads and processes
    it starts there inherit them), then on its former cores again."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)  # 0: the calling thread, on Linux
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class _PinWorker:
    """DataLoader ``worker_init_fn``: run the worker process on ``cores``."""

    def __init__(self, cores: list[int] | None) -> None:
        self.cores = cores

    def __call__(self, worker_id: int) -> None:
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)


# -- the steps --------------------------------------------------------------------

class ProxyStep:
    """``ops`` tiny in-place ops on ``device``: launch-bound, like a GPU step's Python side."""

    def __init__(self, device: str, ops: int) -> None:
        self.device = torch.device(device)
        self.ops = ops
        self.x = torch.zeros(256, device=self.device)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        x = self.x
        for _ in range(self.ops):
            x.add_(1.0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class ModelTrainStep:
    """One SGD step of :class:`~feeder.bench.model.ModelStep` on the first ``images``
    samples of each batch, synchronized on CUDA."""

    def __init__(self, device: str, images: int) -> None:
        from .model import ModelStep

        self.step = ModelStep(device)
        self.images = images

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.step(images[:self.images], labels[:self.images])
        self.step.synchronize()


def make_step(spec: dict[str, Any]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    if spec["step"] == "proxy":
        return ProxyStep(spec["device"], int(spec["proxy_ops"]))
    if spec["step"] == "model":
        return ModelTrainStep(spec["device"], int(spec["model_batch"]))
    raise ValueError(f"unknown step {spec['step']!r}; expected one of {STEPS}")


# -- the loaders --------------------------------------------------------------------

class WorkThreads:
    """``threads`` plain Python threads doing only the per-sample work into a ring of
    preallocated batches, handed to the loop through a ``queue.Queue``.

    Each thread fills whole batches on its own (sample ``i`` of the cycle goes to
    the thread ``i // batch_size % threads``), so there is no engine at all: what
    this costs the training thread is the per-sample work's own GIL traffic.
    """

    def __init__(self, root: str, batch_size: int, threads: int, queue_size: int, seed: int,
                 device: str = "cpu") -> None:
        from .. import ImageFolder
        from ..sample.rng import sample_key
        from .loaders import sample_work

        self.source = ImageFolder(root)
        self.work = sample_work()
        self.key = sample_key
        self.seed = seed
        self.batch_size = batch_size
        self.device = torch.device(device)
        h, w = self.work.image_size
        # The loop holds one batch and the queue ``queue_size``; each thread fills one more.
        ring = queue_size + 1 + threads
        self.images = [torch.empty((batch_size, h, w, 3), dtype=torch.uint8) for _ in range(ring)]
        self.labels = [torch.empty((batch_size,), dtype=torch.int64) for _ in range(ring)]
        self.ready: queue.Queue = queue.Queue(maxsize=queue_size)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._fill, args=(k, threads, ring), daemon=True,
                                         name=f"work-thread-{k}") for k in range(threads)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _fill(self, k: int, threads: int, ring: int) -> None:
        n = len(self.source)
        B = self.batch_size
        batch = k
        while not self.stop.is_set():
            slot = batch % ring
            images, labels = self.images[slot].numpy(), self.labels[slot].numpy()
            for j in range(B):
                i = (batch * B + j) % n
                data, label = self.source.read(i)
                self.work(data, self.key(self.seed, 0, i), images[j])
                labels[j] = label
            while not self.stop.is_set():
                try:
                    self.ready.put(slot, timeout=0.1)
                    break
                except queue.Full:
                    continue
            batch += threads

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            slot = self.ready.get(timeout=600)
            images, labels = self.images[slot].permute(0, 3, 1, 2), self.labels[slot]
            if self.device.type == "cuda":  # in next(), as the other loaders copy: not in the timed step
                images, labels = images.to(self.device), labels.to(self.device)
            yield images, labels

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=10)


class LoaderCPU:
    """CPU seconds the loader has used so far: this process's threads other than
    those the training loop had before the loader started (the training thread and
    the step's own, such as torch's intra-op pool), plus its child processes'
    (DataLoader's workers, feeder's worker).

    Precise to microseconds (``getrusage``, and the loop's and the children's
    threads' ``schedstat``, in nanoseconds), so a window of a fraction of a
    second tells an idle loader (a few timed-out waits) from a working one.

    Args:
        loop_threads: thread ids of this process that belong to the training loop
            (:func:`own_threads` taken after one step, before the loader started).
    """

    def __init__(self, loop_threads: frozenset[str] = frozenset()) -> None:
        self.pids = _child_pids()
        self.loop_threads = loop_threads

    def __call__(self) -> float:
        import resource

        # This process's CPU less the loop's threads', so that a loader thread that
        # has exited (a pass that ended) still counts.
        own = resource.getrusage(resource.RUSAGE_SELF)
        total = own.ru_utime + own.ru_stime - sum(_threads_cpu(os.getpid(), only=self.loop_threads))
        for pid in self.pids:
            total += sum(_threads_cpu(pid))
        return total


def own_threads() -> frozenset[str]:
    """The thread ids of this process now."""
    return frozenset(os.listdir("/proc/self/task"))


def _threads_cpu(pid: int, only: frozenset[str] | None = None) -> Iterator[float]:
    """CPU seconds of each of ``pid``'s live threads (those in ``only``, if given)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tasks:
        if only is not None and tid not in only:
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                yield int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue


def _child_pids() -> list[int]:
    """This process's live children (and theirs), from /proc."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        parent[int(name)] = int(stat[stat.rfind(")") + 2:].split()[1])
    found, frontier = [], [os.getpid()]
    while frontier:
        me = frontier.pop()
        kids = [pid for pid, pp in parent.items() if pp == me]
        found += kids
        frontier += kids
    return found


class Windows:
    """The training loop of one run: alternating idle and fed windows.

    An *idle* window first lets the loader run dry (the loop keeps stepping on its
    last batch without taking new ones until the loader's CPU use falls below
    ``idle_share`` of a core over ``probe_s``), then times ``window_s`` of steps:
    the training thread alone, with the loader present but idle. A *fed* window
    times ``window_s`` of steps while the loop takes a batch every ``period_s``
    (a share of the loader's capacity measured in the warm-up), so the loader
    works all through it and the loop does not sleep in ``next()`` between steps
    (a step right after a sleep is slower on its own: cold caches, an idle core
    waking up). Each fed window is compared with the idle windows either side of
    it, measured seconds apart, so the machine's own drift cancels.
    """

    def __init__(self, step: Callable[..., None], batches: Iterator, batch: tuple,
                 cpu: Callable[[], float], window_s: float, idle_share: float = 0.05,
                 probe_s: float = 0.2, drain_limit_s: float = 10.0) -> None:
        self.step = step
        self.batches = batches
        self.batch = batch
        self.cpu = cpu
        self.window_s = window_s
        self.idle_share = idle_share
        self.probe_s = probe_s
        self.drain_limit_s = drain_limit_s

    def idle(self) -> dict[str, Any]:
        """Drain, then one timed idle window."""
        t0 = now()
        c_last, t_last = self.cpu(), now()
        drained = False
        while now() - t0 < self.drain_limit_s:
            self.step(*self.batch)
            t = now()
            if t - t_last >= self.probe_s:
                c = self.cpu()
                if (c - c_last) / (t - t_last) < self.idle_share:
                    drained = True
                    break
                c_last, t_last = c, t
        drain_s = now() - t0
        c0, t_start = self.cpu(), now()
        steps = []
        while now() - t_start < self.window_s:
            a = now()
            self.step(*self.batch)
            steps.append(now() - a)
        span = now() - t_start
        return {"steps": steps, "span_s": span, "loader_cpu": max(0.0, self.cpu() - c0) / span,
                "drained": drained, "drain_s": drain_s}

    def fed(self, period_s: float) -> dict[str, Any]:
        """One timed fed window: a new batch every ``period_s``, at least one step
        not right after a wait."""
        c0, t_start = self.cpu(), now()
        due = t_start
        steps: list[float] = []
        images = taken = 0
        next_s = next_cpu_s = slept_s = 0.0
        stalls = 0
        after_wait = False
        while True:
            a = now()
            # A window ends after ``window_s`` with at least one clean step: on a busy
            # machine a late first batch can outlast a short window, which would leave
            # it nothing to compare (bounded by ``drain_limit_s``).
            if a - t_start >= self.window_s and (steps or a - t_start >= self.drain_limit_s):
                break
            if a >= due:
                ca = time.thread_time()
                self.batch = next(self.batches)
                b = now()
                cpu = time.thread_time() - ca
                images += self.batch[0].shape[0]
                taken += 1
                next_s += b - a
                next_cpu_s += cpu
                # Slept in next() (the batch was late): the next step starts cold. Time the
                # training thread spent working in next() (DataLoader rebuilds the batch
                # there) is not a wait.
                slept = max(0.0, (b - a) - cpu)
                after_wait = slept > 1e-3
                slept_s += slept
                stalls += after_wait
                due = max(due + period_s, b)  # late: the next one is due now, no burst
            a = now()
            self.step(*self.batch)
            if not after_wait:
                steps.append(now() - a)
            after_wait = False
        span = now() - t_start
        return {"steps": steps, "span_s": span, "loader_cpu": max(0.0, self.cpu() - c0) / span,
                "images": images, "batches": taken, "wait_s": next_s, "next_cpu_s": next_cpu_s,
                "slept_s": slept_s, "stalls": stalls}


def _cycle(loader: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    epoch = 0
    while True:
        yield from loader.epoch(epoch)
        epoch += 1


def _synthetic(batch_size: int, device: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch_size, 224, 224, 3), dtype=torch.uint8, generator=gen)
    images = images.to(device).permute(0, 3, 1, 2)  # channels_last, as the loaders deliver
    labels = torch.randint(0, 1000, (batch_size,), generator=gen).to(device)
    while True:
        yield images, labels


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One run, in the child process: pin, build the step and the loader, time the steps.

    Returns:
        The runner's report: ``images`` delivered and ``wall_s`` spanned in the fed
        windows, and in ``extra`` the windows (``idle``: one more than ``fed``, each
        with its steps' seconds and the loader's CPU share; ``fed`` also with its
        images, seconds waited in ``next()`` and stalls), the loader's capacity,
        the pace and the cores used.
    """
    import cv2

    from .loaders import Loader

    loop_cores, loader_cores = spec.get("loop_cores"), spec.get("loader_cores")
    if loop_cores is not None:
        os.sched_setaffinity(0, loop_cores)
        torch.set_num_threads(len(loop_cores))
    cv2.setNumThreads(1)  # as in every loader here: each of its threads is one core's worth
    step = make_step(spec)
    # One step before the loader starts, so that the threads the step starts (torch's
    # intra-op pool, CUDA's) exist and are told apart from the loader's.
    step(*next(_synthetic(spec["batch_size"], spec["device"])))
    loop_threads = own_threads()
    row = spec["loader"]
    threads = len(loader_cores) if loader_cores is not None else int(spec["loader_threads"])
    closer: Callable[[], None] = lambda: None
    feeder = None
    with on_cores(loader_cores):
        if row is None:
            batches = _synthetic(spec["batch_size"], spec["device"])
        elif row["kind"] == "work-thread":
            wt = WorkThreads(spec["root"], spec["batch_size"], threads, spec["queue_size"], spec["seed"],
                             spec["device"])
            wt.start()
            batches, closer = wt.batches(), wt.close
        else:
            opts: dict[str, Any] = {}
            if row["kind"] == "feeder":
                opts = dict(decode_threads=threads, augment_threads=0,
                            feeder_options=row.get("options") or {})
            else:
                opts = dict(workers=threads, persistent_workers=True,
                            worker_init_fn=_PinWorker(loader_cores))
            loader = Loader(row["kind"], spec["root"], spec["batch_size"], queue_size=spec["queue_size"],
                            device=spec["device"], seed=spec["seed"],
                            starting=lambda: on_cores(loader_cores), **opts)
            feeder = loader.feeder
            batches, closer = _cycle(loader), loader.close
    warmup = int(spec["warmup"])
    extra: dict[str, Any] = {"loop_cores": loop_cores, "loader_cores": loader_cores,
                             "loader_threads": threads}
    try:
        batch = None
        for _ in range(warmup):
            batch = next(batches)
            step(*batch)
        # The loader's capacity: batches back to back once its queue is empty.
        for _ in range(int(spec["queue_size"]) + 2):
            batch = next(batches)
        t0, n = now(), 0
        while n == 0 or now() - t0 < float(spec["capacity_s"]):
            batch = next(batches)
            n += batch[0].shape[0]
        capacity = n / max(now() - t0, 1e-9)
        period = spec["batch_size"] / (float(spec["feed_share"]) * capacity) if row is not None else 0.0
        loop = Windows(step, batches, batch, LoaderCPU(loop_threads), float(spec["window_s"]))
        idle = [loop.idle()]
        fed = []
        for _ in range(int(spec["windows"])):
            fed.append(loop.fed(period))
            idle.append(loop.idle())
        extra.update({"capacity_images_per_s": capacity if row is not None else None,
                      "period_s": period, "idle": idle, "fed": fed})
        if feeder is not None:
            s = feeder.stats()
            extra["stages"] = {st.name: {"busy_s": st.busy_s, "wait_input_s": st.wait_input_s,
                                         "wait_output_s": st.wait_output_s, "items": st.items}
                               for st in s.stages}
    finally:
        closer()
    images = sum(w["images"] for w in extra["fed"])
    span = sum(w["span_s"] for w in extra["fed"])
    return {"images": images if row is not None else 0, "wall_s": span, "cpu_s": 0.0,
            "first_batch_s": 0.0, "extra": extra}
