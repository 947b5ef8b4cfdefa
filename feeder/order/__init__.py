"""Which samples each pass delivers, in which order, and where a resumed pass
starts. :mod:`~feeder.order.plan` is the one source of epoch orders, built on
:mod:`~feeder.order.sequence` (lazy orders), :mod:`~feeder.order.epoch` (each
epoch's order and the ranks' shards) and :mod:`~feeder.order.group` (aspect-ratio
grouping); resume is :mod:`~feeder.order.progress` (what a pass has handled),
:mod:`~feeder.order.state` (the saved state and its checks) and
:mod:`~feeder.order.cursor` (the feeder's position between passes)."""
