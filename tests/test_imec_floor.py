"""The IMEC floor script (`calibration/imec_floor.py`) scores what it claims to score: its fits
see only the 11 IMEC training runs, split between the papers' values and IMEC's copies by the
share it reports."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np

SCRIPT = Path(__file__).resolve().parent.parent / "calibration" / "imec_floor.py"


def _script():
    spec = importlib.util.spec_from_file_location("imec_floor", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stub_problem(ids):
    """What `variant_weights` reads of a `calibrate._fit.Problem`: the rows and their weights (the
    balance factors make them differ from 1; one row is unmeasured)."""
    w_t = np.array([[0.7, 0.0, 0.0], [1.3, 0.0, 0.0], [2.0, 2.0, 0.0], [0.0, 0.0, 0.0],
                    [0.5, 0.0, 0.0], [0.9, 0.0, 0.0]])
    w_i = np.ones((2, 4))
    ds = SimpleNamespace(train_rows=[SimpleNamespace(id=i) for i in ids])
    return SimpleNamespace(ds=ds, base_weights=lambda: (w_t, w_i))


def test_floor_fits_weigh_only_the_imec_runs_by_the_share():
    mod = _script()
    ids = ["imec-korthi-1t-full", "imec-korthi-1t-full-paper", "nemo-llama3-8b",
           "imec-selene-1t-paper", "imec-inf-a100-tp1", "narayanan21-t1-1.7b"]
    w_t, w_i = mod.variant_weights(_stub_problem(ids), 0.4)
    # IMEC's copy 0.6, the paper twin 0.4, every measured column alike; the unmeasured twin,
    # other tables and the inference rows (also the imec-inf latency points) weigh nothing.
    np.testing.assert_allclose(w_t, [[0.6, 0, 0], [0.4, 0, 0], [0, 0, 0], [0, 0, 0],
                                     [0, 0, 0], [0, 0, 0]])
    assert not w_i.any()


def test_floor_mape_is_the_mean_absolute_percentage_error_of_the_chosen_rows():
    mod = _script()
    ds = SimpleNamespace(train_rows=[SimpleNamespace(id=i) for i in ("a", "b", "c")],
                         y_train=np.log([[10.0, 1, 1], [20.0, 1, 1], [5.0, 1, 1]]),
                         m_train=np.array([[1.0, 0, 0], [1.0, 0, 0], [1.0, 0, 0]]))
    lp = np.log([[11.0, 1, 1], [19.0, 1, 1], [50.0, 1, 1]])
    # (10 % + 5 %) / 2; row c is not among the scored ids
    assert abs(mod.mape_of(SimpleNamespace(ds=ds), lp, {"a", "b"}) - 7.5) < 1e-9
