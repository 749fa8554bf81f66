"""`search train|infer --all-plans FILE` (issue 40, part 4): every feasible plan streamed to a
file in chunks, the same rows as `evaluate_all` keeps."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pandas as pd
import pytest

from diffperf.cli._all_plans import AllPlansWriter, sweep_sink
from diffperf.explore import Grid, evaluate_all, run_sweep


def _point(v):
    obj = 1.0 + 0.1 * v["a"] + 0.01 * v["b"] + 0.5 * v["c"]
    sec = 1e9 * (1.0 + v["b"])
    reason = jnp.where(jnp.mod(v["a"] * v["b"] + v["c"], 5.0) == 0, 7, 0).astype(jnp.int32)
    return obj, sec, reason


GRID = {"a": list(range(9)), "b": list(range(11)), "c": [0.0, 0.25, 0.5]}


@pytest.mark.parametrize("chunk_rows", [7, 1 << 16])
def test_streamed_plans_are_evaluate_alls_feasible_rows(tmp_path, chunk_rows):
    """Blocks of 33 points, chunks of 7 rows (many partial writes) or one chunk: the file holds
    exactly the feasible points of `evaluate_all`, in flat order, with their objective and
    secondary (scaled to GB), and as many rows as the sweep counts feasible."""
    grid = Grid(GRID)
    path = str(tmp_path / "all.csv")
    writer = AllPlansWriter(path, chunk_rows=chunk_rows)
    res = run_sweep(grid, _point, k=3, progress=False, max_block=33,
                    sink=sweep_sink(writer, grid, "objective", "secondary_gb", 1e-9))
    assert writer.close() == res.feasible
    got = pd.read_csv(path)
    ref = evaluate_all(grid, lambda v: dict(zip(("obj", "sec", "reason"), _point(v))),
                       progress=False)
    ok = np.nonzero(ref["reason"] == 0)[0]
    assert list(got.columns) == ["flat_index", "a", "b", "c", "objective", "secondary_gb"]
    assert got["flat_index"].tolist() == ok.tolist()
    values = grid.decode_host(ok)
    assert got["a"].dtype.kind == "i" and got["c"].dtype.kind == "f"  # whole-number axes
    for name in GRID:
        np.testing.assert_array_equal(got[name].to_numpy(), values[name])
    np.testing.assert_allclose(got["objective"], ref["obj"][ok], rtol=1e-6)
    np.testing.assert_allclose(got["secondary_gb"], ref["sec"][ok] * 1e-9, rtol=1e-6)
    assert got["objective"].min() == pytest.approx(float(res.top_value[0]), rel=1e-6)


def test_no_feasible_plan_writes_the_header_only(tmp_path):
    grid = Grid({"a": [1.0, 2.0]})
    path = str(tmp_path / "none.csv")
    writer = AllPlansWriter(path)
    run_sweep(grid, lambda v: (v["a"], v["a"], jnp.int32(3) + 0 * v["a"].astype(jnp.int32)),
              k=1, progress=False, sink=sweep_sink(writer, grid, "t", "m"))
    assert writer.close() == 0
    assert (tmp_path / "none.csv").read_text().strip() == "flat_index,a,t,m"


def test_search_infer_all_plans(tmp_path, capsys):
    """`search infer --all-plans`: one row per feasible plan, plan axes first."""
    from diffperf.cli import main
    path = tmp_path / "infer.csv"
    assert main(["search", "infer", "--model", "llama2-7b", "--gpu", "h100-sxm5-80gb",
                 "--max-gpus", "2", "--all-plans", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    df = pd.read_csv(path)
    assert len(df) == out["feasible"] > 0
    assert list(df.columns[:4]) == ["tp", "pp", "ep", "batch"]
    best = out["top"][0]
    assert df["output_tok_s_per_gpu"].max() == pytest.approx(best["output_tok_s_per_gpu"],
                                                             rel=1e-6)


def test_all_plans_refusals(tmp_path, capsys):
    from diffperf.cli import main
    base = ["search", "infer", "--model", "llama2-7b", "--max-gpus", "2"]
    assert main(base + ["--all-plans", str(tmp_path / "x.txt")]) == 2
    assert "use a .csv or .parquet file name" in capsys.readouterr().err
    assert main(base + ["--all-plans", str(tmp_path / "x.csv"), "--distributed",
                        "--coordinator", "127.0.0.1:1", "--num-processes", "1",
                        "--process-id", "0"]) == 2
    assert "not available with --distributed" in capsys.readouterr().err
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        assert main(base + ["--all-plans", str(tmp_path / "x.parquet")]) == 2
        assert "needs pyarrow" in capsys.readouterr().err


@pytest.mark.slow
def test_search_train_all_plans_holds_every_feasible_plan(tmp_path, capsys):
    """`search train --all-plans` (a small search): as many rows as feasible plans, and the
    fastest row is the best plan reported."""
    from diffperf.cli import main
    path = tmp_path / "train.csv"
    assert main(["search", "train", "--model", "gpt-1.7b", "--gpus", "8", "--global-batch",
                 "32", "--precision", "bf16", "--all-plans", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    df = pd.read_csv(path)
    assert len(df) == out["feasible"] > 0
    best = df.loc[df["step_time_s"].idxmin()]
    assert best["step_time_s"] == pytest.approx(out["top"][0]["step_time_s"], rel=1e-6)
    assert df["flat_index"].is_monotonic_increasing


def test_parquet_round_trip(tmp_path):
    pytest.importorskip("pyarrow")
    grid = Grid(GRID)
    path = str(tmp_path / "all.parquet")
    writer = AllPlansWriter(path, chunk_rows=7)
    res = run_sweep(grid, _point, k=3, progress=False, max_block=33,
                    sink=sweep_sink(writer, grid, "objective", "secondary_gb", 1e-9))
    assert writer.close() == res.feasible == len(pd.read_parquet(path))
