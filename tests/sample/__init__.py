"""Tests of feeder.sample: the sample's fields (masks, boxes, instances), the check of what a source returns, the per-sample random stream."""
