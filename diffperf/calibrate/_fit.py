"""Calibration: fit the `Efficiency` factors to published measurements with gradients.

The fit is a grad of a loss of the same pure functions `diffperf validate` evaluates:

    loss(theta) = mean over measured cells of (log predicted - log measured)^2
                + prior_weight * |u_shared - u_default|^2 + group_prior_weight * |delta|^2

- `theta` is an unconstrained vector. Each fitted factor is `u_shared[f]` (shared by all GPUs),
  plus `delta[g, f]` for the factors grouped per GPU generation (`grouping`). Factors stay
  physical through their parameterisation: fractions are `sigmoid(u)` (in (0, 1)), positive
  quantities (sizes, overheads) are `default * softplus(u) / log 2` (u = 0 is the default).
- The prior pulls the shared factors toward the physical defaults of `Efficiency()` and each
  GPU's offsets toward the shared value (partial pooling: a GPU with few rows stays near the
  shared factors); both weights are small.
- Every measured column of every row counts: train `step_time_s`, `tokens_per_s_per_gpu`,
  `model_tflops_per_gpu` (in the row's FLOP convention,
  `validation._stack.causal_flops_convention`); infer `e2e_latency_s`, `ttft_s`, `tpot_s`,
  `output_tok_s_per_gpu`. Rows whose plan is structurally infeasible (anything but "does not fit
  in HBM": those ran in reality) are left out.
- Predictions for all rows are one vmapped call over stacked specs (and a stacked per-row
  `Efficiency`); the loss and its gradient are jit-compiled once per dataset and reused by every
  cross-validation fold (held-out rows get weight 0; several folds run as one batch).
- Optimiser: optax Adam, then L-BFGS (`optax.scale_by_lbfgs` directions with a batched
  backtracking Armijo line search driven from Python, so the expensive model compiles once).
  Everything runs in float64 (`enable_x64()` is called by the entry points before the specs are
  built); there is no randomness.

See `_cv.py` (cross-validation) and `_uncertainty.py` (Laplace
covariance, delta-method prediction intervals).
"""

from __future__ import annotations

import datetime
import hashlib
import math
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._paths import BENCHMARKS_DATA
from ..feasibility import MEMORY_REASONS, explain
from ..inference._infer import infer
from ..specs._efficiency import Efficiency
from ..training._step import model_flops_per_step, train_step
from ..validation._data import BenchmarkRow, read_benchmark_files, read_benchmarks
from ..validation._infer_rows import stacked_infer_specs
from ..validation._stack import causal_flops_convention, constants_static
from ..validation._train_rows import stacked_train_specs
from ._error_data import refit_error_model, residual_records
from ._parameterisation import Parameterisation, enable_x64
from ._results import INFER_COLUMNS, TRAIN_COLUMNS, Fit, mape_summary, predictions_table
from ._sources import source_of
from ._uncertainty import laplace, residual_sds

#: Reason codes kept in the fit: 0 feasible, and the memory reasons (those runs happened).
KEPT_REASONS = (0, *MEMORY_REASONS)
DEFAULT_DATA = ("train_calibration.csv", "infer_calibration.csv", "train_vtrain_h2048.csv")




def benchmarks_dir() -> Path:
    """The shipped `benchmarks_data/` (source checkout / editable install)."""
    return BENCHMARKS_DATA


def default_data_paths() -> list[Path]:
    return [benchmarks_dir() / n for n in DEFAULT_DATA]


def data_sha256(paths) -> str:
    """sha256 over the bytes of the CSV files, in the given order."""
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).read_bytes())
    return h.hexdigest()


# -------------------------------------------------------------------------------- dataset
@dataclass
class Dataset:
    """Benchmark rows turned into stacked float64 specs and log targets (built once)."""

    paths: list
    train: object  # validation._stack.StackedRows
    infer: object
    y_train: np.ndarray  # [Rt, 3] log measured (0 where not measured)
    m_train: np.ndarray  # [Rt, 3] 1 where measured (and the row is kept)
    y_infer: np.ndarray  # [Ri, 4]
    m_infer: np.ndarray
    c_train: np.ndarray  # [Rt, 3] log constants: log pred = c - log(step) for cols 1, 2
    gpus: tuple
    g_train: np.ndarray  # [Rt] index into gpus
    g_infer: np.ndarray
    excluded: list = field(default_factory=list)  # [{"id", "error"}]
    sha256: str = ""

    @property
    def train_rows(self) -> list[BenchmarkRow]:
        return self.train.rows

    @property
    def infer_rows(self) -> list[BenchmarkRow]:
        return self.infer.rows

    def cells(self) -> list[tuple[str, str, str, str, float]]:
        """(kind, row id, gpu, column, measured) of every fitted cell, in loss order."""
        out = []
        for kind, rows, cols, m in (("train", self.train_rows, TRAIN_COLUMNS, self.m_train),
                                    ("infer", self.infer_rows, INFER_COLUMNS, self.m_infer)):
            for i, r in enumerate(rows):
                for j, c in enumerate(cols):
                    if m[i, j] > 0:
                        out.append((kind, r.id, r.values["gpu"], c, r.measured[c]))
        return out

    @property
    def n_cells(self) -> int:
        return int(self.m_train.sum() + self.m_infer.sum())


def _rows_from(data) -> tuple[list[BenchmarkRow], list]:
    """Rows from paths / a DataFrame / BenchmarkRows (DataFrames go through a temp CSV so
    that they get the same checks and error messages)."""
    import pandas as pd
    if data is None:
        data = default_data_paths()
    if isinstance(data, (str, Path)):
        data = [data]
    if isinstance(data, pd.DataFrame):
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "dataframe.csv"
            data.to_csv(p, index=False)
            return read_benchmarks(p), []
    data = list(data)
    if data and all(isinstance(r, BenchmarkRow) for r in data):
        return data, []
    return read_benchmark_files(data), [Path(p) for p in data]


class _Parsed(tuple):
    """(rows, paths) already read (so that a malformed CSV fails before x64 is switched on)."""


def build_dataset(data=None) -> Dataset:
    """Read benchmark CSVs (paths, a DataFrame or parsed rows) into a `Dataset`.

    Call `enable_x64()` first for float64 leaves. Raises `BenchmarkError` (file, row, column)
    for a malformed CSV."""
    rows, paths = data if isinstance(data, _Parsed) else _rows_from(data)
    dup = sorted(i for i, n in Counter(r.id for r in rows).items() if n > 1)
    if dup:
        raise ValueError(f"duplicate row ids across files: {dup[:5]}")
    train = stacked_train_specs([r for r in rows if r.kind == "train"])
    infer = stacked_infer_specs([r for r in rows if r.kind == "infer"])
    excluded = list(train.failed) + list(infer.failed)
    gpus = tuple(sorted({r.values["gpu"] for r in train.rows + infer.rows}))

    def targets(rws, cols):
        y = np.zeros((len(rws), len(cols)))
        m = np.zeros((len(rws), len(cols)))
        for i, r in enumerate(rws):
            for j, c in enumerate(cols):
                if c in r.measured:
                    y[i, j] = math.log(r.measured[c])
                    m[i, j] = 1.0
        return y, m

    y_t, m_t = targets(train.rows, TRAIN_COLUMNS)
    y_i, m_i = targets(infer.rows, INFER_COLUMNS)
    c_t = np.zeros((len(train.rows), 3))
    if train.rows:
        causal = np.array([causal_flops_convention(r) for r in train.rows])
        mf_full = np.asarray(jax.vmap(model_flops_per_step)(train.models, train.plans))
        mf_causal = np.asarray(jax.vmap(lambda m, p: model_flops_per_step(
            m, p, causal_attention=True))(train.models, train.plans))
        mf = np.where(causal, mf_causal, mf_full)
        n = np.asarray(train.plans.num_gpus)
        tokens = np.asarray(train.plans.global_batch) * np.asarray(train.models.seq_len)
        c_t[:, 1] = np.log(tokens / n)
        c_t[:, 2] = np.log(mf / n / 1e12)
    g_t = np.array([gpus.index(r.values["gpu"]) for r in train.rows], dtype=np.int32)
    g_i = np.array([gpus.index(r.values["gpu"]) for r in infer.rows], dtype=np.int32)
    sha = data_sha256(paths) if paths else ""
    return Dataset(paths, train, infer, y_t, m_t, y_i, m_i, c_t, gpus, g_t, g_i, excluded, sha)


# ----------------------------------------------------------------------------------- loss
def make_loss(ds: Dataset, par: Parameterisation, prior_weight: float = 1e-3,
              group_prior_weight: float = 1e-2) -> Callable:
    """The pure loss `loss(theta, w_train, w_infer) -> (value, aux)`.

    `w_train` [Rt, 3] and `w_infer` [Ri, 4] weight each cell's squared log ratio (0 = not
    used: unmeasured, excluded or held out); the data term is their weighted mean. `aux` =
    (log predictions train [Rt, 3], infer [Ri, 4], reason codes train, infer)."""
    tr, inf = ds.train, ds.infer
    y_t, y_i = jnp.asarray(ds.y_train), jnp.asarray(ds.y_infer)
    c_t = jnp.asarray(ds.c_train)
    g_t = jnp.asarray(ds.g_train if par.groups else np.full(len(ds.g_train), -1, np.int32))
    g_i = jnp.asarray(ds.g_infer if par.groups else np.full(len(ds.g_infer), -1, np.int32))
    if par.groups and tuple(par.groups) != tuple(ds.gpus):
        remap = np.array([par.groups.index(g) if g in par.groups else -1 for g in ds.gpus],
                         dtype=np.int32)
        g_t, g_i = jnp.asarray(remap[ds.g_train]), jnp.asarray(remap[ds.g_infer])
    u0 = jnp.asarray(par.prior_center())
    has_t, has_i = len(tr.rows) > 0, len(inf.rows) > 0
    # What every row shares enters the trace as constants (see `validation._stack.constants_static`)
    specs_t = (constants_static((tr.models, tr.systems, tr.plans, tr.runtimes)) if has_t
               else None)
    specs_i = (constants_static((inf.models, inf.systems, inf.plans, inf.runtimes)) if has_i
               else None)

    def loss(theta, w_t, w_i):
        total = jnp.zeros(())
        wsum = jnp.zeros(())
        if has_t:
            eff = par.row_efficiency(theta, g_t)
            rep = eqx.filter_vmap(lambda m, s, p, rt, e: train_step(m, s, p, e, rt))(
                *specs_t, eff)
            ls = jnp.log(rep.step_time)
            lp_t = jnp.stack([ls, c_t[:, 1] - ls, c_t[:, 2] - ls], axis=1)
            r = jnp.where(w_t > 0, lp_t - y_t, 0.0)
            total = total + jnp.sum(w_t * r ** 2)
            wsum = wsum + jnp.sum(w_t)
            reason_t = rep.reason
        else:
            lp_t, reason_t = jnp.zeros((0, 3)), jnp.zeros((0,), jnp.int32)
        if has_i:
            eff = par.row_efficiency(theta, g_i)
            rep = eqx.filter_vmap(lambda m, s, p, rt, e: infer(m, s, p, e, rt))(
                *specs_i, eff)
            lp_i = jnp.log(jnp.stack([rep.e2e_latency, rep.ttft, rep.tpot,
                                      rep.output_tok_s_per_gpu], axis=1))
            r = jnp.where(w_i > 0, lp_i - y_i, 0.0)
            total = total + jnp.sum(w_i * r ** 2)
            wsum = wsum + jnp.sum(w_i)
            reason_i = rep.reason
        else:
            lp_i, reason_i = jnp.zeros((0, 4)), jnp.zeros((0,), jnp.int32)
        u, delta = par.split(theta)
        prior = prior_weight * jnp.sum((u - u0) ** 2) + group_prior_weight * jnp.sum(delta ** 2)
        return total / jnp.maximum(wsum, 1e-30) + prior, (lp_t, lp_i, reason_t, reason_i)

    return loss


# ------------------------------------------------------------------------------ optimiser
@dataclass
class OptimResult:
    theta: np.ndarray  # [F, P]
    loss: np.ndarray  # [F]
    aux: tuple  # batched aux of the final thetas
    iterations: int
    converged: np.ndarray  # [F] bool


class Problem:
    """A dataset + parameterisation with the loss and its gradient jit-compiled once (batched
    over folds: theta [F, P], weights [F, Rt, 3], [F, Ri, 4])."""

    def __init__(self, ds: Dataset, par: Parameterisation, prior_weight=1e-3,
                 group_prior_weight=1e-2, balance: float = 0.0):
        import optax
        self.ds, self.par = ds, par
        self.prior_weight, self.group_prior_weight = prior_weight, group_prior_weight
        self.loss = make_loss(ds, par, prior_weight, group_prior_weight)
        self.vg = jax.jit(jax.vmap(jax.value_and_grad(self.loss, has_aux=True)))
        self._adam_cache = {}
        lb = optax.scale_by_lbfgs(memory_size=10)
        self._lb_init = jax.jit(jax.vmap(lb.init))
        self._lb_update = jax.jit(jax.vmap(lb.update))
        self._reasons = None
        self.balance = float(balance)

    def base_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """Weights of every usable cell: measured and not structurally infeasible."""
        if self._reasons is None:
            theta = np.asarray(self.par.theta_from())[None]
            w_t, w_i = self.ds.m_train[None], self.ds.m_infer[None]
            (_, aux), _ = self.vg(theta, w_t, w_i)
            self._reasons = (np.asarray(aux[2][0]), np.asarray(aux[3][0]))
        r_t, r_i = self._reasons
        keep_t = np.isin(r_t, KEPT_REASONS)[:, None]
        keep_i = np.isin(r_i, KEPT_REASONS)[:, None]
        w_t, w_i = self.ds.m_train * keep_t, self.ds.m_infer * keep_i
        if self.balance:
            # Each source group's cells weigh n_source^-balance (renormalised to mean 1), so a
            # 100-row table does not drown an 11-row one (balance = 1: every source counts the
            # same; 0: every cell counts the same).
            src = [source_of(r) for r in self.ds.train_rows + self.ds.infer_rows]
            w = np.concatenate([w_t.sum(1), w_i.sum(1)])
            counts = {}
            for s_, n in zip(src, w):
                counts[s_] = counts.get(s_, 0.0) + n
            f = np.array([max(counts[s_], 1.0) ** -self.balance for s_ in src])
            f = f * w.sum() / max((f * w).sum(), 1e-30)
            nt = len(self.ds.train_rows)
            w_t, w_i = w_t * f[:nt, None], w_i * f[nt:, None]
        return w_t, w_i

    def infeasible(self) -> list[dict]:
        """Rows left out of the fit because their plan is structurally infeasible."""
        self.base_weights()
        out = []
        for rows, reasons in ((self.ds.train_rows, self._reasons[0]),
                              (self.ds.infer_rows, self._reasons[1])):
            for r, c in zip(rows, reasons):
                if int(c) not in KEPT_REASONS:
                    out.append({"id": r.id, "error": explain(int(c))})
        return out

    def optimize(self, theta0, w_t, w_i, adam_steps=150, lbfgs_steps=300, lr=0.05,
                 ftol=1e-12, gtol=1e-8, progress=None) -> OptimResult:
        """Minimise the loss for F folds at once (theta0 [F, P] or [P])."""
        import optax
        theta = jnp.asarray(np.atleast_2d(theta0), dtype=jnp.result_type(float))
        nf = theta.shape[0]
        w_t = jnp.asarray(np.broadcast_to(w_t, (nf,) + self.ds.m_train.shape))
        w_i = jnp.asarray(np.broadcast_to(w_i, (nf,) + self.ds.m_infer.shape))
        if lr not in self._adam_cache:
            adam = optax.adam(lr)
            self._adam_cache[lr] = (adam.init, jax.jit(adam.update))
        a_init, a_update = self._adam_cache[lr]
        state = a_init(theta)
        it = 0
        for k in range(adam_steps):
            (val, aux), g = self.vg(theta, w_t, w_i)
            upd, state = a_update(g, state)
            theta = theta + upd
            it += 1
            if progress and (k % 10 == 0 or k == adam_steps - 1):
                progress("adam", k + 1, adam_steps, float(jnp.mean(val)))
        (val, aux), g = self.vg(theta, w_t, w_i)
        lstate = self._lb_init(theta)
        done = np.zeros(nf, bool)
        val_np = np.asarray(val)
        for k in range(lbfgs_steps):
            d, lstate = self._lb_update(g, lstate, theta)
            d = -d
            slope = jnp.sum(g * d, axis=1)
            bad = ~(slope < 0)
            d = jnp.where(bad[:, None], -g, d)
            slope = jnp.where(bad, -jnp.sum(g * g, axis=1), slope)
            step = np.ones(nf)
            accepted = done.copy()
            new_theta, new_val, new_g, new_aux = theta, val, g, aux
            for _ in range(40):
                cand = theta + jnp.asarray(step)[:, None] * d * jnp.asarray(~done)[:, None]
                (cv, caux), cg = self.vg(cand, w_t, w_i)
                cv_np = np.asarray(cv)
                ok = (~accepted & np.isfinite(cv_np)
                      & (cv_np <= val_np + 1e-4 * step * np.asarray(slope)))
                if ok.any():
                    okj = jnp.asarray(ok)
                    sel = lambda a, b, okj=okj: jnp.where(
                        okj.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
                    new_theta, new_val = sel(cand, new_theta), sel(cv, new_val)
                    new_g = sel(cg, new_g)
                    new_aux = jax.tree.map(sel, caux, new_aux)
                    accepted |= ok
                if accepted.all():
                    break
                step = np.where(accepted, step, step * 0.5)
            failed = ~accepted
            new_val_np = np.asarray(new_val)
            change = np.abs(val_np - new_val_np) <= ftol * np.maximum(1.0, np.abs(val_np))
            gmax = np.asarray(jnp.max(jnp.abs(new_g), axis=1))
            done = done | failed | (change & (gmax < gtol * 1e4)) | (gmax < gtol)
            theta, val, g, aux, val_np = new_theta, new_val, new_g, new_aux, new_val_np
            it += 1
            if progress and (k % 5 == 0 or done.all()):
                progress("lbfgs", k + 1, lbfgs_steps, float(np.mean(val_np)))
            if done.all():
                break
        return OptimResult(np.asarray(theta), val_np, jax.device_get(aux), it, done)


def calibrate(data=None, fields=None, grouping=None, adam_steps: int = 150,
              lbfgs_steps: int = 300, prior_weight: float = 1e-3,
              group_prior_weight: float = 1e-2, balance: float = 0.0,
              start: Efficiency | dict | None = None,
              uncertainty: bool = True, progress=None, problem: Problem | None = None,
              command: str = "") -> Fit:
    """Fit the efficiency factors to benchmark rows.

    **Arguments:**

    - `data`: CSV path(s), a pandas DataFrame in the benchmark schema, or parsed rows
      (default: the shipped `benchmarks_data/` train and infer sets).
    - `fields`: factors to fit (default `DEFAULT_FIELDS`: all but `memory_reserve`).
    - `grouping`: `{factor: "gpu"}` for factors fitted per GPU generation (default
      `DEFAULT_GROUPING`; `{}` = everything shared).
    - `adam_steps`, `lbfgs_steps`: Adam steps, then at most this many L-BFGS iterations.
    - `prior_weight`, `group_prior_weight`: weights of the prior on the shared coordinates
      (toward the physical defaults) and on the per-GPU offsets (toward 0).
    - `balance`: 0 = every measured cell weighs the same (the plain mean); 1 = every source
      group (`_sources.source_group`) weighs the same; in between: n_source^-balance.
    - `start`: start point (default the physical defaults; the prior always pulls toward them).
    - `uncertainty`: compute the Laplace covariance (`_uncertainty.laplace`).
    - `progress`: optional `progress(stage, step, total, loss)` callback; stages `read`
      (reading the CSVs), `specs` (building the specs of `total` rows), `compile`, `adam`,
      `lbfgs`.
    - `problem`: a prebuilt `Problem` (reuses its compiled loss).

    **Returns:** a `Fit`. Enables float64 (`jax_enable_x64`).
    """
    t0 = time.perf_counter()
    where = ""  # the data files, for an error about the data as a whole
    if problem is None:
        if progress:
            progress("read", 0, 1, float("nan"))
        parsed = _Parsed(_rows_from(data))  # raises BenchmarkError (file, row, column) first
        if parsed[1]:
            where = " of " + ", ".join(str(p) for p in parsed[1])
        if progress:
            progress("specs", 0, len(parsed[0]), float("nan"))
        enable_x64()
        ds = build_dataset(parsed)
        groups = ds.gpus if (grouping is None or grouping) else ()
        par = Parameterisation.build(fields, grouping, groups)
        if progress:
            progress("compile", 0, 1, float("nan"))
        problem = Problem(ds, par, prior_weight, group_prior_weight, balance)
    enable_x64()
    ds, par = problem.ds, problem.par
    w_t, w_i = problem.base_weights()
    if w_t.sum() + w_i.sum() == 0:
        raise ValueError(f"no usable measured values in the data{where} (no rows, or every "
                         f"row is infeasible or unmeasured)")
    theta0 = par.theta_from(start)
    res = problem.optimize(theta0, w_t, w_i, adam_steps, lbfgs_steps, progress=progress)
    theta = res.theta[0]
    lp_t, lp_i = res.aux[0][0], res.aux[1][0]
    preds = predictions_table(ds, lp_t, lp_i, w_t, w_i)
    shared, per_gpu = par.factors(theta)
    residual_sd = residual_sds(preds)
    meta = {
        "data_sha256": ds.sha256, "data_files": [p.name for p in ds.paths],
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "loss": float(res.loss[0]), "n_cells": len(preds), "n_params": par.size,
        "iterations": res.iterations, "converged": bool(res.converged[0]),
        "in_sample_mape": mape_summary(preds), "jax_version": jax.__version__,
        "command": command, "prior_weight": prior_weight,
        "group_prior_weight": group_prior_weight, "balance": problem.balance,
        "excluded_rows": [e["id"] for e in ds.excluded + problem.infeasible()],
        "residual_sd_basis": "in-sample",
    }
    fit = Fit(par, theta, float(res.loss[0]), shared, per_gpu, preds,
              ds.excluded + problem.infeasible(), meta, residual_sd=residual_sd,
              problem=problem, error_records=residual_records(preds, fitted=True))
    refit_error_model(fit, leave_source_out=False)
    if uncertainty:
        fit.covariance = laplace(problem, theta, w_t, w_i)
    meta["fit_seconds"] = round(time.perf_counter() - t0, 2)
    return fit


