"""Fit and check the host costs of the `megatron-deepspeed-2023` runtime on the vTrain runs.

The runtime's operator counts and its collective host cost come from the code and published
measurements (diffperf/presets/runtimes.json); one value is fitted: the host time per eager
operator (forward and backward tied), by a grid search of the mean absolute percentage error of
the step time, with 5-fold cross-validation (random folds, seed 0). The efficiency factors are
the shipped A100 ones, except `host_overhead`, held at 1: this fits the preset's reference value
on the vTrain runs alone. The shipped calibration (`calibration/refit.py`) fits these runs with
every other table and learns `Efficiency.host_overhead`, the factor on the preset's host times.

    python calibration/fit_runtime.py            # prints the fit, CV MAPE, errors by TP / mb / pp
    python calibration/fit_runtime.py --json     # the same, as JSON
    python calibration/fit_runtime.py --cells    # also the per-(TP, micro-batch) decomposition

The decomposition (`--cells`): the runs are affine in the number of micro-batches m, so for
each TP degree and micro-batch (pipeline 1, the smallest DP degree) a least-squares fit of
step = a + b L + m (c + d L) over the layer counts L and m splits the measured and the predicted
(fitted host time) step into a time per layer and micro-batch (d) and a time per micro-batch
outside the layers (c: LM head, loss, embedding, input preparation, host work), ms.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import diffperf as dp  # noqa: E402
from diffperf.presets import runtime  # noqa: E402
from diffperf.validation import stack  # noqa: E402
from diffperf.validation._data import read_benchmarks, train_specs  # noqa: E402

DATA = ROOT / "benchmarks_data" / "train_vtrain_h2048.csv"
GRID = np.arange(0.0, 60.5e-6, 1e-6)  # host time per operator, s
FOLDS, SEED = 5, 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--cells", action="store_true",
                        help="also split each (TP, micro-batch) cell into per-layer and "
                             "per-micro-batch times")
    args = parser.parse_args()
    rows = read_benchmarks(DATA)
    specs = [train_specs(r) for r in rows]
    models, systems, plans = (stack([s[i] for s in specs]) for i in range(3))
    measured = np.array([r.measured["step_time_s"] for r in rows])
    eff = eqx.tree_at(lambda e: e.host_overhead, dp.default_efficiency("a100-sxm4-80gb"),
                      jnp.asarray(1.0, jnp.result_type(float)))
    preset = runtime("megatron-deepspeed-2023")

    @jax.jit
    def step_times(t_op):
        rt = eqx.tree_at(lambda r: (r.host_op_time, r.host_backward_op_time), preset,
                         (t_op, t_op))
        return jax.vmap(lambda m, s, p: dp.train_step(m, s, p, eff, rt).step_time)(
            models, systems, plans)

    predicted = np.stack([np.asarray(step_times(jnp.float32(t))) for t in GRID])
    errors = np.abs(predicted / measured - 1.0)  # [grid, rows]
    folds = np.random.default_rng(SEED).permutation(len(rows)) % FOLDS
    ratio_cv, chosen = np.zeros(len(rows)), []
    for k in range(FOLDS):
        train, test = folds != k, folds == k
        best = int(np.argmin(errors[:, train].mean(axis=1)))
        chosen.append(float(GRID[best]))
        ratio_cv[test] = (predicted[best] / measured)[test]
    best_all = int(np.argmin(errors.mean(axis=1)))
    no_host = np.asarray(step_times(jnp.float32(0.0))) / measured
    plans_np = jax.device_get(plans)
    groups = {}
    for name, key in (("tp", plans_np.tp), ("micro_batch", plans_np.micro_batch),
                      ("pp", plans_np.pp)):
        groups[name] = {int(v): {"rows": int((key == v).sum()),
                                 "median_pred_over_measured": float(np.median(ratio_cv[key == v])),
                                 "mape_pct": 100 * float(np.mean(np.abs(ratio_cv[key == v] - 1)))}
                        for v in np.unique(key)}
    cells = _cells(models, plans_np, measured, predicted[best_all]) if args.cells else []
    out = {"rows": len(rows), "fitted_host_op_time_s": float(GRID[best_all]),
           "preset_host_op_time_s": float(preset.host_op_time),
           "fold_choices_s": chosen,
           "cv_mape_pct": 100 * float(np.mean(np.abs(ratio_cv - 1))),
           "in_sample_mape_pct": 100 * float(errors[best_all].mean()),
           "no_host_mape_pct": 100 * float(np.mean(np.abs(no_host - 1))), "by": groups,
           **({"cells": cells} if args.cells else {})}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{out['rows']} vTrain runs; host time per operator fitted: "
          f"{out['fitted_host_op_time_s'] * 1e6:.0f} us (preset: "
          f"{out['preset_host_op_time_s'] * 1e6:.0f} us; folds chose "
          f"{', '.join(f'{c * 1e6:.0f}' for c in chosen)} us)")
    print(f"MAPE: without a host stream {out['no_host_mape_pct']:.1f} %, fitted in-sample "
          f"{out['in_sample_mape_pct']:.1f} %, 5-fold cross-validated {out['cv_mape_pct']:.1f} %")
    for name, table in groups.items():
        cells = "; ".join(f"{v}: {c['mape_pct']:.1f} % (median ratio "
                          f"{c['median_pred_over_measured']:.2f}, {c['rows']} rows)"
                          for v, c in table.items())
        print(f"  by {name}: {cells}")
    if args.cells:
        print("per layer and micro-batch / per micro-batch outside the layers, ms "
              "(measured, predicted):")
        for c in out["cells"]:
            print(f"  tp {c['tp']} mb {c['micro_batch']}: layer {c['layer_measured_ms']:.2f} "
                  f"/ {c['layer_predicted_ms']:.2f}, outside {c['outside_measured_ms']:.2f} / "
                  f"{c['outside_predicted_ms']:.2f}")


def _cells(models, plans, measured, predicted) -> list[dict]:
    """The per-(TP, micro-batch) decomposition of the module docstring (cells whose rows vary
    both L and m)."""
    layers = np.asarray(jax.device_get(models).layers)
    tp, mb, pp, dp_ = (np.asarray(x) for x in (plans.tp, plans.micro_batch, plans.pp, plans.dp))
    m = np.asarray(plans.num_micro_batches)
    out = []
    for t in np.unique(tp):
        for b in np.unique(mb):
            cell = (tp == t) & (mb == b) & (pp == 1)
            if not cell.any():
                continue
            cell &= dp_ == dp_[cell].min()
            x = np.stack([np.ones(cell.sum()), layers[cell], m[cell], m[cell] * layers[cell]], 1)
            if np.linalg.matrix_rank(x) < 4:
                continue
            fit = {k: np.linalg.lstsq(x, y[cell], rcond=None)[0]
                   for k, y in (("measured", measured), ("predicted", predicted))}
            out.append({"tp": int(t), "micro_batch": int(b), "rows": int(cell.sum()),
                        **{f"layer_{k}_ms": 1e3 * float(v[3]) for k, v in fit.items()},
                        **{f"outside_{k}_ms": 1e3 * float(v[2]) for k, v in fit.items()}})
    return out


if __name__ == "__main__":
    main()
