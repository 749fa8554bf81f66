"""Picture of a plan search: the Pareto front of two objectives, the best plans marked.

`diffperf search train --plot F.png` (memory per GPU vs step time) and `diffperf search infer
--plot F.png` (output tokens/s per GPU vs end-to-end latency) draw it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ._labels import emptiest_corner, place_labels
from ._pyplot import pyplot

if TYPE_CHECKING:
    import pandas as pd


def front_plot(front: pd.DataFrame, best: pd.DataFrame, x: str, y: str, label, path: str | Path,
               xlabel: str, ylabel: str, title: str | None = None, log: bool = True):
    """Save the Pareto front `front` (columns `x`, `y`) as a step line with one point per plan,
    each annotated with `label(row)` (its plan, e.g. "tp8 pp4"), and the plans of `best`
    (the ranked list the command prints) as stars; returns the figure."""
    import pandas as pd
    plt = pyplot("the search plot")
    if front.empty:
        raise ValueError("search plot: the Pareto front is empty (no feasible plan)")
    f = front.sort_values(x)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    ax.step(f[x], f[y], where="post", color="0.6", lw=1, zorder=1)
    ax.scatter(f[x], f[y], s=18, zorder=2, label=f"Pareto front ({len(f)} plans)")
    if len(best):
        ax.scatter(best[x], best[y], marker="*", s=90, color="C3", zorder=3,
                   label=f"best {len(best)} (as printed)")
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    # the labels go where there is room: no two overlap, nor a marker or the legend
    everything = pd.concat([f[[x, y]], best[[x, y]]]) if len(best) else f[[x, y]]
    legend = ax.legend(fontsize=8, loc=emptiest_corner(ax, everything[x], everything[y]))
    fig.tight_layout()
    sx, sy = f[x].to_numpy(), f[y].to_numpy()  # the step line's corners
    step = (np.repeat(sx, 2)[1:], np.repeat(sy, 2)[:-1])
    place_labels(ax, f[x], f[y], [label(r) for _, r in f.iterrows()], fontsize=6,
                 avoid=[legend], others=(best[x], best[y]) if len(best) else None,
                 lines=[step])
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig
