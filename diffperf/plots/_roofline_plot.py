"""The roofline plot of a `diffperf.boundedness` table: achieved FLOP/s against arithmetic
intensity, one point per compute operation, under the machine-balance roof."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..specs._hardware import System
from ._labels import emptiest_corner, place_labels
from ._pyplot import pyplot

if TYPE_CHECKING:
    import pandas as pd


def roofline_plot(df: pd.DataFrame, path, system: System | None = None, title: str | None = None):
    """Save a roofline plot (achieved FLOP/s vs arithmetic intensity) of the compute operations
    of a `boundedness` table to `path` (any format matplotlib writes). The roofs are drawn from
    the table's machine balance and, if given, `system`'s HBM bandwidth. Needs matplotlib
    (`pip install diffperf[plot]`).

    **Returns:** the matplotlib Figure.
    """
    plt = pyplot("roofline_plot")
    ops = df[(df["flops"] > 0) & (df["bytes"] > 0)]
    if ops.empty:
        raise ValueError("roofline_plot: the table has no operation with FLOPs and bytes")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for phase, marker in (("prefill", "o"), ("decode", "s")):
        sub = ops[ops["phase"] == phase]
        ax.scatter(sub["intensity"], sub["flops"] / sub["time_s"], marker=marker, label=phase)
    balance = float(ops["machine_balance"].iloc[0])
    lines = []
    if system is not None:
        bw = float(system.accelerator.hbm_bandwidth)
        xs = np.logspace(np.log10(ops["intensity"].min() / 2),
                         np.log10(max(ops["intensity"].max(), balance) * 2), 200)
        ax.plot(xs, np.minimum(xs * bw, balance * bw), "k-", lw=1, label="roofline")
        lines.append((xs, np.minimum(xs * bw, balance * bw)))
    ax.axvline(balance, color="grey", ls="--", lw=1, label=f"machine balance {balance:.0f} FLOP/B")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / HBM byte)")
    ax.set_ylabel("achieved FLOP/s")
    if title:
        ax.set_title(title)
    # each operation's name where there is room (several GEMMs share a spot): no overlaps
    rate = ops["flops"] / ops["time_s"]
    legend = ax.legend(fontsize=8, loc=emptiest_corner(ax, ops["intensity"], rate))
    fig.tight_layout()
    place_labels(ax, ops["intensity"], rate, list(ops["op"]), fontsize=7, avoid=[legend],
                 lines=[*lines, ([balance, balance], ax.get_ylim())])
    fig.savefig(path)
    plt.close(fig)
    return fig
