"""CLI subcommands; each module has `register(subparsers)`. Order here is the order in `redwood --help`."""

import importlib

_NAMES = ["generate", "models", "bench", "data", "tree_search", "acceptance", "profile"]


def _load():
    mods = []
    for name in _NAMES:
        try:
            mods.append(importlib.import_module(f"redwood.commands.{name}"))
        except ModuleNotFoundError as e:  # a command module not written yet
            if e.name != f"redwood.commands.{name}":
                raise
    return mods


COMMAND_MODULES = _load()
