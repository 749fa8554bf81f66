"""Build the notebooks from their cell sources (notebooks/_src/NN_name.py, cells split on
lines '# %%' (code) and '# %% [markdown]'), so that they stay reviewable as plain Python.

    python notebooks/_build.py            # write notebooks/*.ipynb (outputs stripped)
"""
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent


def cells(text: str):
    out, kind, buf = [], None, []
    for line in text.splitlines():
        if line.startswith("# %%"):
            if kind is not None:
                out.append((kind, "\n".join(buf).strip("\n")))
            kind = "markdown" if "[markdown]" in line else "code"
            buf = []
        else:
            buf.append(line[2:] if kind == "markdown" and line.startswith("# ") else
                       ("" if kind == "markdown" and line == "#" else line))
    if kind is not None:
        out.append((kind, "\n".join(buf).strip("\n")))
    return out


def build(src: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    for i, (kind, body) in enumerate(cells(src.read_text())):
        cell = (nbformat.v4.new_markdown_cell(body) if kind == "markdown"
                else nbformat.v4.new_code_cell(body))
        cell["id"] = f"cell-{i}"  # deterministic: rebuilding an unchanged source changes nothing
        nb.cells.append(cell)
    dst = HERE / (src.stem + ".ipynb")
    nbformat.write(nb, dst)
    return dst


if __name__ == "__main__":
    for src in sorted((HERE / "_src").glob("*.py")):
        print(build(src))
