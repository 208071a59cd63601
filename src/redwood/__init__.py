"""redwood: fast, lossless speculative decoding of LLMs."""

from redwood.engine.engine import Engine  # noqa: E402
from redwood.engine.output import RequestDelta  # noqa: E402
from redwood.errors import RedwoodError  # noqa: E402
from redwood.llm import LLM, RequestOutput  # noqa: E402
from redwood.sampling_params import SamplingParams  # noqa: E402
from redwood.speculation.config import SpeculativeConfig  # noqa: E402
from redwood.version import __version__  # noqa: E402,F401

__all__ = [
    "LLM",
    "Engine",
    "RequestDelta",
    "SamplingParams",
    "SpeculativeConfig",
    "RequestOutput",
    "RedwoodError",
    "__version__",
]
