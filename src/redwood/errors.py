"""Errors that redwood reports to users.

Every failure a user can cause (a bad path, a bad parameter, a corrupt file, no network) is raised as a
subclass of `RedwoodError` carrying a message that says what went wrong and what to do. The CLI prints
these as one line and exits with status 2; anything else is a bug and keeps its traceback.
"""


class RedwoodError(Exception):
    """Base class of the errors redwood reports to users (one clear message, no traceback)."""


class ConfigError(RedwoodError, ValueError):
    """An invalid configuration or parameter value."""


class ModelLoadError(RedwoodError):
    """A model path, file or format that cannot be loaded."""


class UnsupportedModelError(ModelLoadError):
    """A model architecture, rope scaling or quantization type redwood does not implement."""


class DownloadError(RedwoodError):
    """A registry download or model assembly that failed."""


class RegistryUnavailableError(DownloadError):
    """The package index could not provide a package (no network, the index down, the package gone):
    pip itself failed, as opposed to a download that arrived but was wrong."""


class ContextLengthError(RedwoodError, ValueError):
    """A prompt (plus the requested generation) that does not fit the model's context."""


class RankFailure(RedwoodError):
    """A tensor-parallel rank died, hung past the collectives' timeout or could not join the group
    (`redwood.parallel`): every rank stops with one line naming it where it can tell."""
