"""Tests of feeder.order: epoch orders, the plan, aspect-ratio groups, resume (elastic too)."""
