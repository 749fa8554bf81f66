"""The one record of where the shipped published measurements live.

`benchmarks_data/` sits beside the package in a source checkout (and an editable install); a
wheel does not carry it, so callers that need it check that it exists."""

from __future__ import annotations

from pathlib import Path

#: The repository's `benchmarks_data/` folder.
BENCHMARKS_DATA = Path(__file__).resolve().parent.parent / "benchmarks_data"
