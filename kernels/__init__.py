"""Kernels for the engine, each beside its PyTorch reference: Triton (paged attention, KV store, W8A16/W4A16
matmuls) and C++ for float32 on the CPU (csrc/: paged decode attention, RMSNorm, SiLU-and-mul, rotary)."""
