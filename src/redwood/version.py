"""redwood's version (one place: the package, the CLI's --version and the cost-model cache key read it)."""

__version__ = "0.1.0"
