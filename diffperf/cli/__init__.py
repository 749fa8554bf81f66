"""The `diffperf` command line: argparse only, one module per group of subcommands."""

from ._main import build_parser as build_parser, main as main
