"""How the target's forward runs fast: packed and stacked linear layers, grouped-query attention over
the cache in place, the in-place KV cache, the lean verification loop and its CUDA-graph replay, and
(:mod:`diffdraft.kernels.quantized`) a GGUF target's quantized blocks kept for its matmuls."""
