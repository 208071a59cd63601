"""Fused Triton kernels for the decoder layer (RMSNorm, SwiGLU, rotary + KV-cache write)."""
