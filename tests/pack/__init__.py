"""Tests of feeder.pack and the feeder-pack command."""
