"""The `redwood` command line: one subcommand per module in `redwood.commands`.

Each command module exposes `register(subparsers)`, which adds its parser and sets `func` (called with the
parsed arguments; returns an exit status). User errors (`RedwoodError`) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from redwood.errors import RedwoodError


class VersionAction(argparse.Action):
    """`redwood --version`: the version, then which build of the C++ CPU kernels this machine runs
    (`kquant.describe`: chosen, and built on first use, as a generation would)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from redwood import __version__
        from redwood.cpu_kernels import kquant

        print(f"{parser.prog} {__version__}\n{kquant.describe()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    from redwood.commands import COMMAND_MODULES

    parser = argparse.ArgumentParser(
        prog="redwood",
        description="Fast, lossless speculative decoding of LLMs (MagicDec + Sequoia).",
    )
    parser.add_argument("--version", action=VersionAction, nargs=0, help="show the version and the CPU kernels' build")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from redwood.progress import set_quiet

    set_quiet(getattr(args, "quiet", False))  # a command's --quiet also silences loading / prefill progress
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # (inside the try: a reader that went away shows here, not at exit)
        return status
    except RedwoodError as e:
        print(f"redwood: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("redwood: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`redwood generate … | head`): end quietly, as coreutils do; point stdout at
        # devnull so the interpreter's final flush does not raise again
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
