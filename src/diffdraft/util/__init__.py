"""Small utilities that import nothing else of diffdraft: atomic writes, the cache root, progress bars,
tokenizer fingerprints and staged directories."""
