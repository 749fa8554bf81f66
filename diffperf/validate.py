"""`diffperf validate`: predict every row of benchmark CSVs and compare with the measurements."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .data import BenchmarkRow, read_benchmark_files, train_specs
from .efficiency import Efficiency
from .feasibility import MEMORY_REASONS, describe_failure, explain
from .presets import efficiency_for
from .training import model_flops_per_step, train_step


def stack(trees):
    """Stack a list of pytrees with identical structure along a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def constants_static(tree):
    """A stacked `tree` with every leaf whose values are equal along the batch replaced by that
    one value as a Python float. `eqx.filter_vmap` broadcasts such leaves instead of mapping
    them, and the model sees them concrete: trace-time specialisation
    (`Transformer.known_absent` / `known_present`) and XLA's constant folding then apply to what
    all rows share (e.g. no row of the shipped data has MLA or shared experts)."""
    def one(x):
        a = np.asarray(x)
        return float(a[0]) if a.ndim == 1 and a.size and np.all(a == a[0]) else x
    return jax.tree.map(one, tree)


def causal_flops_convention(row: BenchmarkRow) -> bool:
    """True for sources whose model TFLOP/s count causal (half) attention FLOPs: Megatron-Bridge
    tables (see benchmarks_data/SOURCES.md, 'Two model-FLOP conventions')."""
    return "megatron-bridge" in row.source.lower() or row.id.startswith("mbridge")


#: Validation evaluates a few hundred rows once: compile time dominates, so LLVM's expensive
#: optimisation passes (2x the compile time, nothing measurable at run time here) are skipped.
FAST_COMPILE = {"xla_llvm_disable_expensive_passes": True}


@eqx.filter_jit(compiler_options=FAST_COMPILE)
def _train_batch(models, systems, plans, effs, causal):
    def one(m, s, p, e, c):
        r = train_step(m, s, p, e)
        mf = jnp.where(c, model_flops_per_step(m, p, causal_attention=True),
                       model_flops_per_step(m, p))
        return r, mf
    return jax.vmap(one)(models, systems, plans, effs, causal)


class StackedRows(NamedTuple):
    """Specs of the evaluable rows of one kind, stacked along a leading row axis (built with
    the float dtype in force when called: float64 under `jax_enable_x64`)."""

    rows: list  # the BenchmarkRows that could be turned into specs, in order
    models: object  # stacked Transformer
    systems: object  # stacked System
    plans: object  # stacked TrainingPlan / InferencePlan
    failed: list  # [{"id", "error"}] of rows whose specs are invalid


def stack_specs(rows: list[BenchmarkRow], to_specs) -> StackedRows:
    """Stack the `(Transformer, System, plan)` that `to_specs(row)` builds for every row (rows
    whose specs raise ValueError go to `failed`). Models are None when no row is valid."""
    ok, failed, specs = [], [], []
    for row in rows:
        try:
            specs.append(to_specs(row))
            ok.append(row)
        except ValueError as e:
            failed.append({"id": row.id, "error": str(e)})
    if not ok:
        return StackedRows([], None, None, None, failed)
    models, systems, plans = (stack([s[i] for s in specs]) for i in range(3))
    return StackedRows(ok, models, systems, plans, failed)


def stacked_train_specs(rows: list[BenchmarkRow]) -> StackedRows:
    """`stack_specs` of train rows (`(Transformer, System, TrainingPlan)`)."""
    return stack_specs(rows, train_specs)


def row_efficiencies(rows: list[BenchmarkRow], efficiency: Efficiency | None):
    """One `Efficiency` per row, stacked: each row's GPU factors (see `efficiency_for`)."""
    cache = {}
    for r in rows:
        g = r.values["gpu"]
        if g not in cache:
            cache[g] = efficiency_for(efficiency, g)
    return stack([cache[r.values["gpu"]] for r in rows])


def predict_train_rows(rows: list[BenchmarkRow], eff: Efficiency | None = None,
                       stacked: StackedRows | None = None):
    """Predictions for train rows: (list of (row, {metric: predicted}, warning)), failed list.

    `eff`: one `Efficiency` for every row, a `GpuEfficiency` (each row gets its GPU's factors)
    or None (the shipped default, per GPU). `stacked`: the rows' `stacked_train_specs`, if
    already built."""
    st = stacked if stacked is not None else stacked_train_specs(rows)
    ok, failed = st.rows, list(st.failed)
    if not ok:
        return [], failed
    models, systems, plans = st.models, st.systems, st.plans
    causal = jnp.asarray([causal_flops_convention(r) for r in ok])
    rep, mflops = _train_batch(models, systems, plans, row_efficiencies(ok, eff), causal)
    rep, mflops = jax.device_get((rep, mflops))
    out = []
    for i, row in enumerate(ok):
        reason = int(rep.reason[i])
        if reason not in (0, *MEMORY_REASONS):
            model, _, plan = train_specs(row)
            failed.append({"id": row.id, "error": describe_failure(reason, model, plan)})
            continue
        n = float(rep.num_gpus[i])
        step = float(rep.step_time[i])
        pred = {
            "step_time_s": step,
            "tokens_per_s_per_gpu": float(rep.tokens_per_s_per_gpu[i]),
            "model_tflops_per_gpu": float(mflops[i]) / step / n / 1e12,
            "peak_memory_gb": float(rep.memory.total[i]) / 1e9,
        }
        host = (rep.memory.host[i], systems.accelerator.host_memory[i])
        out.append((row, pred, capacity_warning(reason, rep.memory.total[i],
                                                systems.accelerator.hbm_capacity[i], *host)))
    return out, failed


def capacity_warning(reason: int, memory_total, capacity, host_total=None,
                     host_capacity=None) -> str | None:
    """The message of a plan that does not fit in HBM (reason 10) or, with offloading, in host
    memory (reason 12), with the numbers; None for other reasons. HBM is checked first, so an
    HBM overflow also names a host-memory overflow."""
    has_host = host_total is not None and host_capacity is not None
    host = (explain(12, float(host_total), float(host_capacity)) if has_host else explain(12))
    if reason == 12:
        return host
    if reason != 10:
        return None
    text = explain(10, float(memory_total), float(capacity))
    return f"{text}; {host}" if has_host and float(host_total) > float(host_capacity) else text


def validate(paths, efficiency: Efficiency | None = None) -> dict:
    """Predict every row of the CSV files in `paths` and compare with each measured column.

    `efficiency`: an `Efficiency` used for every row, a `GpuEfficiency` (e.g. from
    `efficiency_from_json` of a fitted file with `per_gpu` entries: each row uses its GPU's
    factors), or None: the shipped calibration, per GPU.

    **Returns:** `{"rows": [...], "summary": {metric: {"n", "mape", "max_ape"}}, "failed": [...],
    "defaults": [...], "warnings": [...], "implausible": [...]}` as in docs/benchmark-format.md (APE
    in percent); `implausible` lists measurements faster than ideal hardware could run the
    row's recorded configuration (`plausibility.implausible_measurements`).
    """
    eff = efficiency
    if isinstance(paths, (str, Path)):
        paths = [paths]
    rows = read_benchmark_files(paths)
    train = [r for r in rows if r.kind == "train"]
    infer = [r for r in rows if r.kind == "infer"]
    from .inference_validate import predict_infer_rows, stacked_infer_specs
    st_train, st_infer = stacked_train_specs(train), stacked_infer_specs(infer)
    predictions, failed = predict_train_rows(train, eff, st_train)
    if infer:
        more, more_failed = predict_infer_rows(infer, eff, st_infer)
        predictions += more
        failed += more_failed
    out_rows, warnings = [], []
    for row, pred, warning in predictions:
        if warning:
            warnings.append({"id": row.id, "warning": warning})
        for metric, measured in row.measured.items():
            p = pred.get(metric)
            if p is None or not np.isfinite(p):
                failed.append({"id": row.id, "error": f"no finite prediction for {metric}"})
                continue
            out_rows.append({"id": row.id, "source": row.source, "metric": metric,
                             "measured": measured,
                             "predicted": p, "ape": abs(p - measured) / measured * 100.0})
    summary = summarize(out_rows)
    suspect = [{"id": r["id"], "metric": r["metric"],
                "warning": f"{r['metric']} {r['measured']:.4g} is {_ratio(r):.3g}x off the "
                           f"prediction {r['predicted']:.4g}: a unit mix-up"
                           + (" (ms for s?)" if r["metric"].endswith("_s") else "?")}
               for r in out_rows if _ratio(r) > UNIT_SUSPECT_RATIO]
    defaults = [{"id": r.id, "defaults": r.defaults_used} for r in rows if r.defaults_used]
    from .plausibility import implausible_measurements
    return {"rows": out_rows, "summary": summary, "failed": failed, "defaults": defaults,
            "warnings": warnings, "suspect_units": suspect,
            "implausible": implausible_measurements(rows, (st_train, st_infer))}


#: A measurement this many times off its prediction (either way) is flagged as a likely unit
#: mix-up; the model's largest miss on the shipped data is below 3x.
UNIT_SUSPECT_RATIO = 20.0


def _ratio(row: dict) -> float:
    """How many times apart a validation row's measurement and prediction are (>= 1)."""
    q = row["predicted"] / row["measured"]
    return max(q, 1.0 / q)


def summarize(rows: list[dict]) -> dict:
    """Per-metric count, MAPE and max APE (percent) of validation rows."""
    summary: dict[str, dict] = {}
    for metric in dict.fromkeys(r["metric"] for r in rows):
        apes = np.array([r["ape"] for r in rows if r["metric"] == metric])
        summary[metric] = {"n": int(apes.size), "mape": float(apes.mean()),
                           "max_ape": float(apes.max())}
    return summary


def subset_summary(result: dict, prefix: str | tuple[str, ...], suffix: str | None = None,
                   exclude_suffix: str | None = None) -> dict:
    """Summary restricted to row ids starting with `prefix` (e.g. 'imec-'), optionally also
    ending with `suffix` or not ending with `exclude_suffix`."""
    rows = [r for r in result["rows"] if r["id"].startswith(prefix)
            and (suffix is None or r["id"].endswith(suffix))
            and (exclude_suffix is None or not r["id"].endswith(exclude_suffix))]
    return summarize(rows)


#: Named subsets reported by `diffperf validate` (Kundu et al.'s validation points).
IMEC_SUBSETS = {
    "IMEC training (11 Megatron runs, IMEC values)": (("imec-korthi-", "imec-selene-"), None, "-paper"),
    "IMEC training (same 11 runs, paper values)": (("imec-korthi-", "imec-selene-"), "-paper",
                                                   None),
    "IMEC inference (22 NVIDIA Llama-2 latency points)": ("imec-inf-", None, None),
}


def imec_summaries(result: dict) -> dict:
    """Summaries of the IMEC subsets present in a validation result."""
    out = {}
    for name, (prefix, suffix, exclude) in IMEC_SUBSETS.items():
        s = subset_summary(result, prefix, suffix, exclude)
        if s:
            out[name] = s
    return out
