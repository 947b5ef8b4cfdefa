"""Cross-cutting tests: bad input, faults, hostile use, shutdown, soak, real distributed runs and trainers, the package's structure, the checkout's scripts."""
