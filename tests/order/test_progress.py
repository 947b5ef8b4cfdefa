"""Progress along a pass's order: a batch that is the order's next samples moves
the position in one comparison, to the same state as counting it sample by sample."""

from __future__ import annotations

import numpy as np
import pytest

from feeder.order.progress import Progress
from feeder.order.sequence import ArrayOrder, Handled


class _Skips:
    def __init__(self) -> None:
        self.skipped_indices: list[int] = []


def _counted(progress: Progress) -> Progress:
    """``progress`` counting sample by sample alone: never the in-order comparison."""
    progress._next_in_order = lambda indices: False  # type: ignore[method-assign]
    return progress


@pytest.mark.parametrize("seed", range(6))
def test_in_order_batches_reach_the_state_of_counting_each_sample(seed):
    rng = np.random.default_rng(seed)
    n, b = 700, 16
    # Some sources repeat samples within a pass (a mixture's small source).
    order = rng.integers(0, 300, n) if seed % 2 else rng.permutation(n)
    batches = [order[a:a + b] for a in range(0, n, b)]
    # Deliver mostly in order, with stragglers: swap some neighbouring batches.
    for k in range(0, len(batches) - 1, 5 + seed):
        batches[k], batches[k + 1] = batches[k + 1], batches[k]
    fast = Progress(0, n, lambda: ArrayOrder(order))
    slow = _counted(Progress(0, n, lambda: ArrayOrder(order)))
    fast.pass_, slow.pass_ = _Skips(), _Skips()
    for k, batch in enumerate(batches):
        if k % 7 == 3 and len(batch) > 2:  # a skipped sample: left out of its batch
            for p in (fast, slow):
                p.pass_.skipped_indices.append(int(batch[1]))
            batch = np.delete(batch, 1)
        fast.record(batch if k % 2 else [int(i) for i in batch])
        slow.record(batch)
        assert fast.position == slow.position
        assert fast.handled() == slow.handled()
    assert fast.position == n and fast.compact() == slow.compact()


def test_a_resumed_pass_with_samples_past_its_position_counts_them():
    order = np.arange(40)
    start = Handled(8, (10, 11))
    fast = Progress(0, 40, lambda: ArrayOrder(order), start=start)
    slow = _counted(Progress(0, 40, lambda: ArrayOrder(order), start=start))
    for batch in ([8, 9, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21]):
        fast.record(np.array(batch))
        slow.record(np.array(batch))
        assert fast.handled() == slow.handled()
    assert fast.position == 22
