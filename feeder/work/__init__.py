"""What is done to each sample: its fields and their checks (``sample``), its
random stream (``rng``), decoding (``decode``, the JPEG region decoder's
geometry in ``region``, the optional C extension ``_jpeg``) and the compiled
transform chain (``augment``, running :mod:`feeder.ops`)."""
