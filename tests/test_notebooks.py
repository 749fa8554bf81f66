"""Every notebook runs top to bottom (so none can silently rot)."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(HERE.glob("*.ipynb"))


def test_every_notebook_is_its_source():
    """Each notebook's cells are exactly those of its plain-Python source in `notebooks/_src`
    (what reviewers read and `notebooks/_build.py` builds from), and every source has its
    notebook: an edit to one side only fails here."""
    sys.path.insert(0, str(HERE))
    try:
        from _build import cells
    finally:
        sys.path.remove(str(HERE))
    sources = sorted((HERE / "_src").glob("*.py"))
    assert [p.stem for p in sources] == [p.stem for p in NOTEBOOKS]
    for src, path in zip(sources, NOTEBOOKS):
        nb = nbformat.read(path, as_version=4)
        assert [(c.cell_type, c.source) for c in nb.cells] == cells(src.read_text()), path.name


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    (tmp_path / "figures").mkdir()
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError with the failing cell on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    assert list((tmp_path / "figures").glob("*.png")), "each notebook saves its figure(s)"
