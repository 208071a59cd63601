"""`redwood models list`, `redwood models pull NAME [NAME ...]` and `redwood models rm NAME`: the model zoo (see
`redwood.models.registry`)."""

from __future__ import annotations

import argparse
import json

from redwood.models import registry


def register(subparsers) -> None:
    parser = subparsers.add_parser("models", help="list and download the known models")
    sub = parser.add_subparsers(dest="models_command", metavar="SUBCOMMAND")
    sub.required = True

    p = sub.add_parser("list", help="show the known models and whether they are downloaded")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_list)

    p = sub.add_parser(
        "pull",
        help="download, assemble and verify a model (a no-op if already there and "
        "intact; a file changed since it was verified is re-hashed)",
    )
    p.add_argument("names", nargs="+", metavar="NAME", help="model names, see `redwood models list`")
    p.add_argument("--force", action="store_true", help="delete the file and download it again in any case")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_pull)

    p = sub.add_parser("rm", help="delete a downloaded model's files")
    p.add_argument("name", metavar="NAME", help="model name, see `redwood models list`")
    p.set_defaults(func=_rm)


def _human(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _list(args: argparse.Namespace) -> int:
    rows = [
        {
            "name": spec.name,
            "size": spec.size,
            "pulled": registry.is_pulled(spec.name),
            "path": str(registry.model_path(spec.name)),
            "sha256": spec.sha256,
            "description": spec.description,
        }
        for spec in registry.known_models().values()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [("NAME", "SIZE", "PULLED", "DESCRIPTION")]
    table += [(r["name"], _human(r["size"]), "yes" if r["pulled"] else "no", r["description"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
    print(f"\nmodels folder: {registry.models_home() / 'models'}")
    return 0


def _pull(args: argparse.Namespace) -> int:
    names = list(dict.fromkeys(args.names))  # (each once, in the order given)
    for name in names:
        registry.model_path(name)  # every name checked before any download (an unknown one: a one-line error)
    for name in names:
        print(registry.pull(name, progress=not args.quiet, force=args.force))
    return 0


def _rm(args: argparse.Namespace) -> int:
    from redwood.errors import ConfigError

    path = registry.model_path(args.name)  # (an unknown name: a one-line error listing the known ones)
    size = path.stat().st_size if path.exists() else 0
    removed = registry.remove(args.name)
    if not removed:
        raise ConfigError(f"{args.name} is not downloaded (nothing in {path.parent})")
    print(f"removed {args.name}: {path}" + (f" ({_human(size)})" if size else ""))
    return 0
