"""GGUF block-quantized weights kept quantized on the CPU: our own matmul kernel, built on first use."""
