"""The decoding loop: verification of a tree (``verify``), the per-sequence rounds (``engine``), the
method table (``method_table``) and batched decoding (``batching``)."""
