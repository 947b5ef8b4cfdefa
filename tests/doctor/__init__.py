"""Tests of feeder.doctor and the feeder-doctor command."""
