"""What the tests measure of this process: the benchmark's own measurements
(:mod:`feeder.bench.measure`), so that a test and ``feeder-bench`` count alike."""

from feeder.bench.measure import resident_bytes

__all__ = ["resident_bytes"]
