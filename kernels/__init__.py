"""Triton kernels for the engine (paged attention, KV store, W8A16/W4A16 matmuls), each beside its PyTorch reference."""
