"""`diffperf search ... --plot`: the picture shows the front and the printed best plans."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from diffperf.cli import main
from diffperf.plots import front_plot  # needs matplotlib ([dev] has it)

PNG = b"\x89PNG\r\n\x1a\n"


def test_points_are_the_front_and_the_best_plans(tmp_path):
    front = pd.DataFrame({"tp": [8, 4, 2], "memory_gb": [30.0, 10.0, 60.0],
                          "step_time_s": [12.0, 20.0, 11.0]})
    best = front.iloc[[2]]
    fig = front_plot(front, best, "memory_gb", "step_time_s", lambda r: f"tp{r['tp']:g}",
                     tmp_path / "f.png", "memory", "time")
    ax = fig.axes[0]
    dots, stars = [c.get_offsets() for c in ax.collections]
    assert sorted(map(tuple, dots)) == [(10.0, 20.0), (30.0, 12.0), (60.0, 11.0)]
    assert list(map(tuple, stars)) == [(60.0, 11.0)]
    assert sorted(t.get_text() for t in ax.texts) == ["tp2", "tp4", "tp8"]
    line = ax.lines[0].get_xydata()
    assert np.all(np.diff(line[:, 0]) >= 0)  # the step line runs in x order
    assert (tmp_path / "f.png").read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match="Pareto front is empty"):
        front_plot(front.iloc[:0], best, "memory_gb", "step_time_s", str, tmp_path / "g.png",
                   "memory", "time")


def test_cli_search_infer_writes_the_plot(tmp_path, capsys):
    out = tmp_path / "front.png"
    assert main(["search", "infer", "--model", "llama2-7b", "--gpu", "h100-sxm5-80gb",
                 "--max-gpus", "2", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG and f"wrote {out}" in capsys.readouterr().err
