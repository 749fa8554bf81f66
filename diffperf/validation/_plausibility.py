"""Can a measurement have come from the configuration its benchmark row records?

A row's *ideal bound* is the model's prediction on ideal hardware: every efficiency 1 (tensor
cores, HBM, L2 and links at their datasheet peaks, no small-GEMM loss), no kernel launch,
kernel or collective overhead, and every overlappable transfer fully hidden. The same work
(the FLOPs and bytes the row's model, batch, precision and parallel plan imply) cannot run
faster than that, except by the slack of the model's smooth maxima (`SLACK`). A measured
time below bound / slack (a throughput above bound x slack) therefore means the recorded
configuration is not what ran: a different batch, precision or parallel plan, or a misprinted
value. Such rows are reported, not silently fitted: no efficiency factor can explain them.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from ..costs._roofline import GEMM_SHARPNESS, SHARPNESS
from ..specs._efficiency import Efficiency
from ._data import BenchmarkRow
from ._infer_rows import predict_infer_rows, stacked_infer_specs
from ._train_rows import predict_train_rows, stacked_train_specs


def _slack(g: float = GEMM_SHARPNESS, k: float = SHARPNESS) -> float:
    """Largest factor by which the model's time can exceed the true maximum of its terms.

    A GEMM's time is smooth_max(smooth_max(compute, HBM, g), L2, k): at most (1 + g) x max
    for the inner one at a tie, and the outer one peaks when the L2 time ties the inner terms,
    at ((2 + g) + sqrt(g^2 + k^2 (2 + g)^2)) / 2 = 1.339 x max for g = 0.3, k = 0.1. A hidden
    transfer's exposed part (`exposed_after_overlap`) is smoothed by at most k / 2 of the
    transfer, which adds at most k / 2 of the true time."""
    return 0.5 * ((2.0 + g) + (g * g + k * k * (2.0 + g) ** 2) ** 0.5) + 0.5 * k


#: Largest factor by which the model's smooth maxima can exceed the true time (1.389).
SLACK = _slack()
#: Measured columns that are times (larger = slower) and rates (larger = faster).
TIME_COLUMNS = ("step_time_s", "e2e_latency_s", "ttft_s", "tpot_s")
RATE_COLUMNS = ("tokens_per_s_per_gpu", "model_tflops_per_gpu", "output_tok_s_per_gpu")


def ideal_efficiency() -> Efficiency:
    """Every fraction of peak 1, every overhead 0, every overlap complete, no size losses."""
    return Efficiency(matmul_peak=1.0, matmul_size_scale=1e-6, matmul_lowp=1.0, attention=1.0,
                      vector=1.0, hbm=1.0, l2=1.0, nvlink=1.0, all_to_all=1.0,
                      scaleout=1.0,
                      kernel_overhead=0.0, collective_overhead=0.0, tp_overlap=1.0,
                      dp_overlap=1.0, pp_overlap=1.0, cp_overlap=1.0, zero3_overlap=1.0,
                      per_head_attention=1.0, memory_reserve=0.0, prefill_attention=1.0)


def _without_launch_cost(stacked):
    """Stacked row specs (`_stack.StackedRows`) on GPUs without kernel launch cost."""
    acc = stacked.systems.accelerator
    return stacked._replace(systems=eqx.tree_at(
        lambda s: s.accelerator.launch_overhead, stacked.systems,
        jnp.zeros_like(acc.launch_overhead)))


def _at_full_gemm_peak(stacked):
    """Stacked inference row specs whose GEMM kernels can issue the full tensor peak: a row's
    `gemm_peak_fraction` is a property of its software, so the bound does not rest on it."""
    plans = stacked.plans
    return stacked._replace(plans=eqx.tree_at(lambda p: p.gemm_peak_fraction, plans,
                                              jnp.ones_like(plans.gemm_peak_fraction)))


def ideal_bounds(rows: list[BenchmarkRow], stacked=None) -> dict[str, dict[str, float]]:
    """`{row id: {column: ideal-hardware prediction}}` for every row that can be predicted:
    `diffperf.validation.predict_train_rows` / `predict_infer_rows` with
    `ideal_efficiency()` on GPUs without launch cost. `stacked`: the rows'
    `(stacked_train_specs, stacked_infer_specs)`, if already built."""
    train = [r for r in rows if r.kind == "train"]
    infer = [r for r in rows if r.kind == "infer"]
    if stacked is None:
        stacked = (stacked_train_specs(train), stacked_infer_specs(infer))
    ideal = ideal_efficiency()
    out: dict[str, dict[str, float]] = {}
    for predict, kind_rows, st, ideal_specs in (
            (predict_train_rows, train, stacked[0], _without_launch_cost),
            (predict_infer_rows, infer, stacked[1],
             lambda s: _at_full_gemm_peak(_without_launch_cost(s)))):
        if st.rows:
            predictions, _ = predict(kind_rows, ideal, ideal_specs(st))
            out.update({row.id: pred for row, pred, _ in predictions})
    return out


def implausible_measurements(rows: list[BenchmarkRow], stacked=None) -> list[dict]:
    """Measured values that beat their row's ideal bound by more than `SLACK` (`stacked`: as
    in `ideal_bounds`).

    **Returns:** `[{"id", "metric", "measured", "bound", "factor", "warning"}]`, where `factor`
    is how many times faster than the ideal bound the measurement is (> `SLACK`)."""
    bounds = ideal_bounds(rows, stacked)
    found = []
    for r in rows:
        for metric, measured in r.measured.items():
            bound = bounds.get(r.id, {}).get(metric)
            if (metric not in TIME_COLUMNS + RATE_COLUMNS or bound is None
                    or not np.isfinite(bound) or bound <= 0):
                continue  # e.g. peak memory: no speed bound
            factor = bound / measured if metric in TIME_COLUMNS else measured / bound
            if factor > SLACK:
                found.append({
                    "id": r.id, "metric": metric, "measured": measured, "bound": bound,
                    "factor": factor,
                    "warning": (f"{metric} {measured:.4g} is {factor:.3g}x beyond the ideal-"
                                f"hardware bound {bound:.4g} of the recorded configuration "
                                f"(100 % of every peak, no overheads): the run cannot have used "
                                f"this batch / precision / plan")})
    return found
