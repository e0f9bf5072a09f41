"""llmctl's PyTorch backend: Llama-family models over a paged KV cache, Triton kernels on GPU."""
