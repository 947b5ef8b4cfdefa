"""Tests of feeder.decode: the decoders (the JPEG region decoder, its row index, files read to their end), and hostile input to them."""
