"""Tests of feeder's top-level modules: Feeder, its iterator, the sources, Mixture, synthetic data, the errors, DataLoader's conventions."""
