"""Cross-validation of a calibration: k-fold, leave-one-source-out and leave-one-out (IMEC).

Folds never split an experiment: a row and its `-paper` twin (the same run, values printed in
the original paper) always go to the same fold, and leave-one-source-out holds out whole
tables. Every fold is a fit from the same start (the physical defaults) on the other rows;
held-out rows get weight 0 in the same compiled loss, and several folds run as one batch.
"""

from __future__ import annotations

import numpy as np

from ._results import mape_summary, predictions_table
from ._sources import IMEC_INFER, IMEC_TRAIN, source_group, twin_key
from ._uncertainty import issues_from_host

CV_KINDS = ("none", "kfold", "source", "loo")


def folds(ds, kind: str = "source", k: int = 5) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Held-out masks `(name, test_train [Rt], test_infer [Ri])` of the folds of `kind`:
    `kfold` (k folds of experiments, deterministic shuffle with seed 0), `source` (one fold per
    source group) or `loo` (one fold per IMEC experiment: 11 training pairs, 22 inference)."""
    ids_t = [r.id for r in ds.train_rows]
    ids_i = [r.id for r in ds.infer_rows]
    all_ids = ids_t + ids_i
    group = {r.id: source_group(r.id, r.source) for r in ds.train_rows + ds.infer_rows}
    if kind == "kfold":
        keys = sorted({twin_key(i) for i in all_ids})
        order = np.random.default_rng(0).permutation(len(keys))
        fold_of = {keys[j]: n % k for n, j in enumerate(order)}
        labels = [f"fold{n}" for n in range(min(k, len(keys)))]
        key = lambda i: f"fold{fold_of[twin_key(i)]}"
    elif kind == "source":
        labels = sorted(set(group.values()))
        key = group.__getitem__
    elif kind == "loo":
        labels = sorted({twin_key(i) for i in all_ids if i.startswith(IMEC_TRAIN + IMEC_INFER)})
        key = twin_key
    else:
        raise ValueError(f"unknown cross-validation {kind!r}; choose from {CV_KINDS}")
    out = []
    for lab in labels:
        tt = np.array([key(i) == lab for i in ids_t], dtype=bool)
        ti = np.array([key(i) == lab for i in ids_i], dtype=bool)
        out.append((lab, tt, ti))
    return out


def cross_validate(problem, kind: str = "source", k: int = 5, batch: int = 8,
                   adam_steps: int = 150, lbfgs_steps: int = 300, progress=None) -> dict:
    """Held-out predictions of every row under `kind` cross-validation.

    **Returns:** `{"kind", "folds": [name...], "predictions": [...per cell, as
    `_results.predictions_table`, plus "fold"], "summary": {...}}` where each cell's
    prediction comes from the fit that did not see its row (or its twin / source)."""
    w_t, w_i = problem.base_weights()
    fl = [f for f in folds(problem.ds, kind, k) if (w_t[f[1]].sum() + w_i[f[2]].sum()) > 0]
    theta0 = problem.par.theta_from()
    preds = []
    batch = max(1, min(batch, len(fl)))
    for start in range(0, len(fl), batch):
        chunk = fl[start:start + batch]
        pad = chunk + [chunk[-1]] * (batch - len(chunk))  # fixed batch: one compiled shape
        wt = np.stack([w_t * ~tt[:, None] for _, tt, _ in pad])
        wi = np.stack([w_i * ~ti[:, None] for _, _, ti in pad])
        prog = None
        if progress:
            last = start + len(chunk)
            prog = lambda st, s, n, loss, a=start, b=last: progress(
                f"cv {kind} folds {a + 1}-{b}/{len(fl)} {st}", s, n, loss)
        res = problem.optimize(np.tile(theta0, (batch, 1)), wt, wi, adam_steps, lbfgs_steps,
                               progress=prog)
        for j, (name, tt, ti) in enumerate(chunk):
            lp_t, lp_i = res.aux[0][j], res.aux[1][j]
            cells = predictions_table(problem.ds, lp_t, lp_i, w_t * tt[:, None],
                                      w_i * ti[:, None])
            for c in cells:
                c["fold"] = name
            preds += cells
    return {"kind": kind, "folds": [f[0] for f in fl], "predictions": preds,
            "summary": summaries(preds)}


def imec_subsets(preds: list[dict]) -> dict:
    """MAPE on the IMEC validation subsets (as in `diffperf validate`)."""
    subsets = {
        "imec-train (IMEC values)": lambda i: i.startswith(IMEC_TRAIN) and not i.endswith("-paper"),
        "imec-train (paper values)": lambda i: i.startswith(IMEC_TRAIN) and i.endswith("-paper"),
        "imec-inf": lambda i: i.startswith(IMEC_INFER),
    }
    out = {}
    for name, sel in subsets.items():
        apes = [p["ape"] for p in preds if sel(p["id"])]
        if apes:
            out[name] = {"n": len(apes), "mape": float(np.mean(apes)),
                         "max_ape": float(np.max(apes))}
    return out


def row_summary(preds: list[dict]) -> dict:
    """MAPE per kind with one error per benchmark row (the mean over the columns it measures:
    a NeMo row's tokens/s and model TFLOP/s are one measurement, not two)."""
    per_row: dict = {}
    for p in preds:
        per_row.setdefault((p["kind"], p["id"]), []).append(p["ape"])
    out: dict = {}
    for (kind, _), apes in per_row.items():
        out.setdefault(kind, []).append(float(np.mean(apes)))
    return {k: {"n": len(v), "mape": float(np.mean(v)), "max_ape": float(np.max(v))}
            for k, v in sorted(out.items())}


#: The `kind` of training cells whose runtime issues its work from the host (eager
#: frameworks: small, host-bound runs), reported apart from the large runs.
HOST_TRAIN_KIND = "train (host-issuing runtime)"


def summaries(preds: list[dict]) -> dict:
    """MAPE per metric, per GPU, per source, per kind (per value and per row; training cells of
    a host-issuing runtime as `HOST_TRAIN_KIND`), and on the IMEC subsets."""
    by_kind = [{**p, "kind": HOST_TRAIN_KIND} if p["kind"] == "train"
               and issues_from_host(p.get("runtime")) else p for p in preds]
    return {"metric": mape_summary(preds), "gpu": mape_summary(preds, "gpu"),
            "source": mape_summary(preds, "source"), "kind": mape_summary(by_kind, "kind"),
            "kind_rows": row_summary(by_kind), "imec": imec_subsets(preds)}
