"""Tests of feeder.storage and the tar shards over it: local, HTTP, S3, cache, index, shard lists, hostile storage."""
