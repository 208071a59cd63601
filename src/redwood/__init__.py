"""redwood: fast, lossless speculative decoding of LLMs."""

__version__ = "0.1.0"
