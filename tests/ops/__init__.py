"""Tests of feeder.ops: the transforms, the compiled chain, the adapters, batch transforms."""
