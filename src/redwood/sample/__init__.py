"""Sampling: the sampler (temperature / top-k / top-p over per-row settings), counter-based and positional
random numbers that run inside CUDA graphs, and the verifiers that accept draft tokens while preserving the
target's distribution (chain rejection sampling, Sequoia's sampling without replacement, SpecInfer, top-k,
match, greedy)."""
