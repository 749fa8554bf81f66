"""The command line run in this process, for the CLI tests (`from cli_run import run`)."""

from __future__ import annotations

from diffperf.cli import main


def run(capsys, *argv):
    """(exit status, stdout, stderr) of `diffperf *argv`, argparse's own exits included."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err
