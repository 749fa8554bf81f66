"""The `diffperf` command line: argparse only, one module per group of subcommands.

`main` is the console entry point. Called without arguments (from `diffperf` or `python -m
diffperf.cli`), it first offers the command to a running `diffperf daemon`
(`_daemon_client`, standard library only: neither `import diffperf` nor this module loads JAX);
with none, or called with an argument list, it runs the command in this process.
"""

import importlib
import sys

from ._daemon_client import run_in_daemon


def main(argv: list[str] | None = None) -> int:
    """Run one `diffperf` command line (default: `sys.argv[1:]`, offered to a daemon first);
    its exit status."""
    if argv is None:
        argv = sys.argv[1:]
        code = run_in_daemon(argv)
        if code is not None:
            return code
    return importlib.import_module("._main", __name__).main(argv)


def __getattr__(name: str):
    if name == "build_parser":  # the parser, without importing JAX until it is asked for
        return importlib.import_module("._main", __name__).build_parser
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
