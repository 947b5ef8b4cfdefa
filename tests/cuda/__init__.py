"""The GPU suite (see ``tests/conftest.py``: the CUDA stand-in without a GPU)."""
