"""Tests of feeder.engine: the stages, queues, buffer pool, transfer (its CUDA logic under the stand-in), stats, tuning."""
