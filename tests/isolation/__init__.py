"""Tests of feeder.isolation: the worker-process engine, its protocol, how it starts."""
