"""The engine: the stages a pass runs, in the training process's threads.

A pass is a line of stages joined by bounded queues (``queue``): the sampler
(``sampler``, its orders in ``order``, ``group`` and ``ranks``) gives each batch a
buffer (``batch``) and dispatches its samples; map stages (``stage``, listed by
``pipeline.topology``) run the per-sample steps (``steps``: read, then decode and augment
through :mod:`feeder.decode`) with reads bounded in bytes (``read``); the collating
loop (``collate``) orders finished batches and the transfer stage (``transfer``,
with ``on_device``) copies them to the device. ``engine.ThreadEngine`` starts,
stops and closes passes (the worker-process engine, :mod:`feeder.isolation`,
shares its base); ``config`` declares every option once; ``stats``, ``tune``,
``threads`` and ``reaper`` are the bookkeeping around them.
"""
