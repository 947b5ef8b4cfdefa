"""The isolated engine (``Feeder(isolation="process")``): the threaded pipeline in one
worker process, batches in shared memory, the transfer stage in the training process.

``docs/design/isolated-engine.md`` ("The isolated engine" on the docs site)
explains the design: why it exists, how buffers are shared, how the start
method is chosen, what a forked worker drops, and its lifetime. The modules:

* ``protocol``: the messages on the control pipe, one dataclass per kind.
* ``worker``: the worker process (a thread engine whose passes end in a shipper).
* ``start``: the start-method rule and the launch.
* ``engine``: :class:`~feeder.isolation.engine.ProcessEngine`, the training process's side.
"""
