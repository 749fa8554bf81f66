"""Issue 41, item 12: the labels of the `infer --plot` roofline and of the `search --plot`
front used to be drawn on top of one another where points crowd; now no two overlap, none
covers a marker, and all stay inside the axes."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text

from diffperf.inference._boundedness import boundedness
from diffperf.plots import front_plot, roofline_plot
from diffperf.presets import default_efficiency, model, system
from diffperf.specs._inference_plan import InferencePlan


def _boxes(fig):
    ax = fig.axes[0]
    canvas = FigureCanvasAgg(fig)  # the pyplot canvas goes with plt.close
    canvas.draw()
    renderer = canvas.get_renderer()
    # the text's own box (an annotation's box also holds its leader line)
    return ax, [Text.get_window_extent(t, renderer) for t in ax.texts]


def _assert_apart(fig, points):
    ax, boxes = _boxes(fig)
    assert boxes
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), (a, b)
    frame = ax.get_window_extent()
    for box in boxes:
        assert frame.x0 - 1 <= box.x0 and box.x1 <= frame.x1 + 1
        assert frame.y0 - 1 <= box.y0 and box.y1 <= frame.y1 + 1
    marks = ax.transData.transform(points)
    for box in boxes:  # no label on a marker (its centre)
        assert not any(box.x0 < x < box.x1 and box.y0 < y < box.y1 for x, y in marks)


def test_a_crowded_search_front_has_no_overlapping_labels(tmp_path):
    """30 plans within a few per cent of each other: the labels used to pile up."""
    n = 30
    front = pd.DataFrame({"tp": np.arange(n), "memory_gb": 50 + np.arange(n) * 0.4,
                          "step_time_s": 20 - np.arange(n) * 0.02})
    best = front.iloc[-10:]
    fig = front_plot(front, best, "memory_gb", "step_time_s",
                     lambda r: f"tp{r['tp']:g} pp8 vp12 mb2 none z1", tmp_path / "f.png",
                     "memory", "time")
    _assert_apart(fig, front[["memory_gb", "step_time_s"]].to_numpy())
    assert sorted(t.get_text() for t in fig.axes[0].texts) == sorted(
        f"tp{i} pp8 vp12 mb2 none z1" for i in range(n))


def test_the_roofline_labels_do_not_overlap(tmp_path):
    """Llama-2 70B decode on 4 H100s: the four GEMMs, the LM head and the norms sit at the same
    intensity; their names were printed over each other."""
    sys_ = system("h100-sxm5-80gb")
    table = boundedness(model("llama2-70b"), sys_, InferencePlan(tp=4, batch=1),
                        default_efficiency("h100-sxm5-80gb"))
    fig = roofline_plot(table, tmp_path / "roof.png", sys_, "llama2-70b")
    ops = table[(table["flops"] > 0) & (table["bytes"] > 0)]
    _assert_apart(fig, np.column_stack([ops["intensity"], ops["flops"] / ops["time_s"]]))
    assert len(fig.axes[0].texts) == len(ops)
