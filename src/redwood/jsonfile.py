"""Reading and writing the small JSON files users hand to redwood (trees, acceptance vectors, profiles)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from redwood.errors import ConfigError


def parse_json(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON ({e.msg} at line {e.lineno})") from None


def read_json(path: str | Path, what: str) -> Any:
    """The parsed contents of a `what` file (e.g. "tree"), with one-line errors for a missing,
    unreadable or malformed file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{what} file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {what} file {path}: {getattr(e, 'strerror', None) or e}") from None
    return parse_json(text, str(path))


def check_format(d: Any, expected: str, source: str) -> None:
    """A versioned redwood file must be a JSON object whose "format" is `expected` (e.g. redwood.tree/1)."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
    if d.get("format") != expected:
        raise ConfigError(f"{source}: format is {d.get('format')!r}, expected {expected!r}")


def write_json(path: str | Path, data: Any) -> Path:
    """Pretty-printed JSON; parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
