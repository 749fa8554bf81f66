"""Picture of a validation run: predicted vs measured, and the signed errors by source.

`diffperf validate --plot F.png` draws it from the rows of `diffperf.validation.validate`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..calibrate._cv import source_group
from ._pyplot import pyplot

#: Shaded band of the error panel: +-10 %, the design target for held-out published runs.
BAND_PCT = 10.0
#: Errors above this many percent are drawn at it, as triangles.
CLIP_PCT = 200.0


def validation_plot(rows: list[dict], path: str | Path, title: str | None = None):
    """Save a two-panel figure of validation rows (`{"id", "metric", "measured",
    "predicted"}` as `diffperf.validation.validate` returns them) to `path`; returns the figure.

    Left: predicted vs measured on log-log axes, one colour per measured column (each point
    in its column's unit: s, tokens/s, TFLOP/s, GB), with the +-10 % lines. Right: the signed
    error 100 * (predicted / measured - 1) of every value, one column of points per source
    group (a paper table or vendor page, `calibrate._sources.source_group`), with its MAPE; errors
    above +200 % are drawn at 200 % as triangles."""
    plt = pyplot("the validation plot")
    rows = [r for r in rows if r["measured"] > 0 and r["predicted"] > 0]
    if not rows:
        raise ValueError("validation plot: no row has a positive measured and predicted value")
    measured = np.array([r["measured"] for r in rows])
    predicted = np.array([r["predicted"] for r in rows])
    error = 100.0 * (predicted / measured - 1.0)
    metrics = sorted({r["metric"] for r in rows})
    group = [source_group(r["id"], r.get("source", "")) for r in rows]
    sources = sorted(set(group))
    src = np.array([sources.index(g) for g in group])
    met = np.array([metrics.index(r["metric"]) for r in rows])
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.2),
                                 gridspec_kw={"width_ratios": [1, max(1.2, len(sources) / 8)]})
    for j, m in enumerate(metrics):
        sel = met == j
        ax.scatter(measured[sel], predicted[sel], s=14, color=colours[j % len(colours)],
                   label=f"{m} (n={int(sel.sum())})")
    lo, hi = min(measured.min(), predicted.min()) / 1.5, max(measured.max(), predicted.max()) * 1.5
    xs = np.array([lo, hi])
    ax.plot(xs, xs, "k-", lw=0.8)
    for f in (1 - BAND_PCT / 100, 1 + BAND_PCT / 100):
        ax.plot(xs, xs * f, "k:", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured (column's unit)")
    ax.set_ylabel("predicted")
    ax.set_title(f"predicted vs measured, {len(rows)} values (dotted: +-{BAND_PCT:g} %)")
    ax.legend(fontsize=7, loc="upper left")

    rng = np.random.default_rng(0)  # fixed horizontal jitter: the same file every run
    bx.axhspan(-BAND_PCT, BAND_PCT, color="0.92")
    bx.axhline(0.0, color="k", lw=0.8)
    shown = np.minimum(error, CLIP_PCT)  # a unit error in a CSV must not flatten the rest
    for i in range(len(sources)):
        sel = src == i
        x = i + rng.uniform(-0.25, 0.25, int(sel.sum()))
        c = np.array([colours[j % len(colours)] for j in met[sel]])
        out = error[sel] > CLIP_PCT
        bx.scatter(x[~out], shown[sel][~out], s=12, c=c[~out])
        if out.any():
            bx.scatter(x[out], shown[sel][out], s=30, c=c[out], marker="^")
        mape = float(np.mean(np.abs(error[sel])))
        bx.annotate(f"{mape:.1f}", (i, 1.0), xycoords=("data", "axes fraction"),
                    ha="center", va="bottom", fontsize=7)
    bx.set_xticks(range(len(sources)))
    bx.set_xticklabels(sources, rotation=35, ha="right", fontsize=8)
    bx.set_xlim(-0.6, len(sources) - 0.4)
    bx.set_ylabel("error, 100 * (predicted / measured - 1) %")
    bx.set_title("signed error by source (MAPE above each column)", pad=14)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig
