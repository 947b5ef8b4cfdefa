"""Tests of feeder.bench and the feeder-bench command."""
