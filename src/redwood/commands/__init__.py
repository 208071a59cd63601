"""CLI subcommands; each module has `register(subparsers)`. Order here is the order in `redwood --help`."""

import importlib

_NAMES = ["generate", "serve", "models", "bench", "data", "tree_search", "acceptance", "profile"]

COMMAND_MODULES = [importlib.import_module(f"redwood.commands.{name}") for name in _NAMES]
