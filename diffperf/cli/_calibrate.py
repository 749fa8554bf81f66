"""`diffperf calibrate`: fit the efficiency factors to benchmark CSVs (with progress on stderr)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..calibrate import _fit as C
from ..calibrate._cv import cross_validate, summaries
from ..calibrate._error_data import use_cross_validated_error
from ..calibrate._fit import benchmarks_dir
from ..calibrate._held_out import measure_held_out
from ..calibrate._sources import source_of
from ..calibrate._uncertainty import INFER_HOLDOUT, MOE_HOLDOUT
from ..validation._data import read_benchmarks
from ..validation._plausibility import implausible_measurements
from ..validation._validate import UNIT_SUSPECT_RATIO


def add_calibrate_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `calibrate` sub-command on an argparse `subparsers` object."""
    p = subparsers.add_parser(
        "calibrate", help="fit the efficiency factors to benchmark measurements",
        description="Fit the efficiency factors (matmul, attention, HBM, network fractions, "
                    "overheads, overlaps) to measured rows with gradients (optax Adam then "
                    "L-BFGS, float64), optionally cross-validate, and write a fitted JSON that "
                    "`diffperf validate --efficiency FILE` and `--efficiency` of train / infer "
                    "accept.")
    p.add_argument("--data", action="append", default=None, metavar="CSV",
                   help="benchmark CSV (repeatable; default: the shipped train and infer sets). "
                        "Each row's software runtime is its `runtime` column (empty: the "
                        "default runtime), so there is no --runtime")
    p.add_argument("--out", required=True, help="fitted efficiency JSON to write")
    p.add_argument("--cv", default="auto", choices=["auto", "none", "kfold", "source", "loo"],
                   help="cross-validation: k-fold over experiments, leave-one-source-out (a "
                        "source: the rows with the same `source` column; shipped tables by id "
                        "prefix), leave-one-out on the IMEC points; source and kfold also fit "
                        "the error model of prediction intervals to the held-out predictions "
                        "(default auto: source when the data has two sources or more, as the "
                        "shipped fit, else none)")
    p.add_argument("--folds", type=int, default=5, help="k of --cv kfold (default 5)")
    p.add_argument("--groups", default="gpu", choices=["gpu", "none"],
                   help="per-GPU-generation factors (gpu, the default) or all shared (none)")
    p.add_argument("--fields", default=None,
                   help="comma-separated factors to fit (default: all but memory_reserve)")
    p.add_argument("--steps", type=int, default=50, help="Adam steps before L-BFGS (default 50)")
    p.add_argument("--lbfgs-steps", type=int, default=300,
                   help="maximum L-BFGS iterations (default 300)")
    p.add_argument("--prior-weight", type=float, default=None,
                   help="weight of the prior toward the physical defaults")
    p.add_argument("--balance", type=float, default=1.0,
                   help="source balance exponent in [0, 1]: 1 (the default, as the shipped "
                        "fit) weighs every source table the same, 0 every measured value")
    p.add_argument("--no-uncertainty", action="store_true",
                   help="skip the Laplace covariance (no prediction intervals from this file)")
    p.add_argument("--moe-holdout", default=None, metavar="CSV",
                   help="training runs kept out of the fit whose errors join the residuals of "
                        "the intervals' error model (default: the shipped MoE runs "
                        "benchmarks_data/train_moe_holdout.csv; 'none' to skip)")
    p.add_argument("--infer-holdout", default=None, metavar="CSV",
                   help="inference rows kept out of the fit whose errors join the residuals of "
                        "the intervals' error model (default: the shipped "
                        "benchmarks_data/infer_trtllm10_holdout.csv; 'none' to skip)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--json", action="store_true", help="print the fit summary as JSON")
    p.set_defaults(func=run_calibrate)
    return p


#: Implausible measurements warned about one per line up to this many (then: their count and
#: the 3 most extreme).
IMPLAUSIBLE_LINES = 5


class _Progress:
    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self, stage, step, total, loss):
        if self.quiet:
            return
        t = time.perf_counter() - self.t0
        if stage == "read":
            msg = f"[{t:5.1f} s] reading the benchmark rows..."
        elif stage == "specs":
            msg = f"[{t:5.1f} s] building the specs of {total:,} rows..."
        elif stage == "compile":
            msg = f"[{t:5.1f} s] compiling the loss and its gradient (once per dataset)..."
        else:
            msg = f"[{t:5.1f} s] {stage} {step}/{total}  loss {loss:.6g}"
        if self.tty:
            print("\r" + msg.ljust(100), end="", file=sys.stderr, flush=True)
        elif stage in ("read", "specs", "compile") or step == total or step % 50 == 1:
            print(msg, file=sys.stderr, flush=True)

    def done(self, msg):
        if not self.quiet:
            end = "\n"
            print(("\r" if self.tty else "") + msg.ljust(100 if self.tty else 0), end=end,
                  file=sys.stderr, flush=True)


def run_calibrate(args) -> int:
    C.enable_x64()
    paths = args.data or [str(p) for p in C.default_data_paths()]
    for p in paths:
        if not Path(p).is_file():
            raise ValueError(f"{p}: file not found")
    out = Path(args.out)
    if out.parent and not out.parent.exists():
        raise ValueError(f"--out {out}: directory {out.parent} does not exist")
    holdout = _holdout_path(args.moe_holdout, MOE_HOLDOUT, "--moe-holdout",
                            "MoE training runs")
    infer_holdout = _holdout_path(args.infer_holdout, INFER_HOLDOUT, "--infer-holdout",
                                  "inference runs")
    # A malformed file fails before the fit.
    holdout_rows = read_benchmarks(holdout) if holdout is not None else []
    infer_rows = read_benchmarks(infer_holdout) if infer_holdout is not None else []
    fields = None
    if args.fields is not None:
        fields = [f.strip() for f in args.fields.split(",") if f.strip()]
        if not fields:
            raise ValueError(f"--fields names no factor (got {args.fields!r}); give comma-"
                             f"separated factor names or leave it out to fit all")
    grouping = None if args.groups == "gpu" else {}
    kwargs = {}
    if args.prior_weight is not None:
        kwargs["prior_weight"] = args.prior_weight
    if not 0.0 <= args.balance <= 1.0:
        raise ValueError(f"--balance must lie in [0, 1], got {args.balance}")
    kwargs["balance"] = args.balance
    prog = _Progress(args.quiet)
    command = "diffperf calibrate " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else ""
    fit = C.calibrate(paths, fields=fields, grouping=grouping, adam_steps=args.steps,
                      lbfgs_steps=args.lbfgs_steps, uncertainty=not args.no_uncertainty,
                      progress=prog, command=command, **kwargs)
    prog.done(f"fit: loss {fit.loss:.6g}, {fit.metadata['n_cells']} measured values, "
              f"{fit.par.size} parameters, {fit.metadata['fit_seconds']} s")
    if fit.metadata["n_cells"] < fit.par.size:
        print(f"warning: {fit.metadata['n_cells']} measured values for {fit.par.size} "
              f"parameters: the data cannot determine every factor, the prior holds the rest "
              f"(fit fewer with --fields, or --groups none)", file=sys.stderr)
    ds = fit.problem.ds
    implausible = implausible_measurements(ds.train_rows + ds.infer_rows)
    if len(implausible) > IMPLAUSIBLE_LINES:  # a count and the worst few, not a line per row
        print(f"warning: {len(implausible)} measurements are faster than ideal hardware could "
              f"run their rows' configurations (fitted anyway: correct those rows or leave them "
              f"out; `diffperf validate --json` lists them all); the most extreme:",
              file=sys.stderr)
        implausible = sorted(implausible, key=lambda b: b["factor"], reverse=True)[:3]
    for bad in implausible:
        print(f"warning: row {bad['id']}: {bad['warning']}; fitted anyway: correct the row or "
              f"leave it out", file=sys.stderr)
    suspect = [c for c in fit.predictions
               if max(c["predicted"] / c["measured"], c["measured"] / c["predicted"])
               > UNIT_SUSPECT_RATIO]
    for c in suspect[:IMPLAUSIBLE_LINES]:
        ratio = max(c["predicted"] / c["measured"], c["measured"] / c["predicted"])
        print(f"warning: row {c['id']}: {c['metric']} {c['measured']:.4g} is {ratio:.3g}x off "
              f"the fitted prediction {c['predicted']:.4g}: a unit mix-up? fitted anyway: "
              f"correct the row or leave it out", file=sys.stderr)
    if len(suspect) > IMPLAUSIBLE_LINES:
        print(f"warning: {len(suspect) - IMPLAUSIBLE_LINES} more measurements are more than "
              f"{UNIT_SUSPECT_RATIO:g}x off their fitted predictions (`diffperf validate "
              f"--json` lists them all)", file=sys.stderr)
    if not fit.metadata.get("converged", True):
        print(f"warning: the fit did not converge in {args.steps} Adam + {args.lbfgs_steps} "
              f"L-BFGS steps (raise --lbfgs-steps); its factors are not at the optimum and "
              f"its prediction intervals are not meaningful", file=sys.stderr)
    if args.cv == "auto":
        args.cv = "source" if len(source_groups(ds)) >= 2 else "none"
        if args.cv == "none" and not args.quiet:
            print("note: one source table: no leave-one-source-out cross-validation (--cv "
                  "auto); the model errors of the intervals are in-sample (--cv kfold for "
                  "held-out ones)", file=sys.stderr)
    if args.cv != "none":
        cv = cross_validate(fit.problem, args.cv, k=args.folds, adam_steps=args.steps,
                            lbfgs_steps=args.lbfgs_steps, progress=prog)
        prog.done(f"cross-validation ({args.cv}): {len(cv['folds'])} folds")
        if args.cv == "kfold" and len(cv["folds"]) < args.folds:
            print(f"warning: --folds {args.folds} but only {len(cv['folds'])} experiments to "
                  f"hold out: ran {len(cv['folds'])} folds (leave-one-out)", file=sys.stderr)
        if args.cv == "source" and len(cv["folds"]) < 2:
            print("warning: one source table only: holding it out leaves nothing but the prior "
                  "to fit, so its 'held-out' error says little", file=sys.stderr)
        fit.cv = {args.cv: cv["summary"]}
        fit.metadata["cv_mape"] = {args.cv: {k: v["mape"] for k, v in
                                             cv["summary"]["metric"].items()}}
        if args.cv in ("source", "kfold"):
            # Prediction intervals for new configurations carry the held-out error.
            use_cross_validated_error(fit, cv["predictions"], args.cv)
    fit.save(out)
    held_lines = [measure_held_out(fit, path, rows, out)
                  for path, rows in ((holdout, holdout_rows), (infer_holdout, infer_rows))
                  if path is not None]
    if any(held_lines):
        fit.save(out)
    ins = summaries(fit.predictions)
    if args.json:
        print(json.dumps({"out": str(out), "loss": fit.loss, "in_sample": ins,
                          "cv": fit.cv, "factors": fit.shared, "per_gpu": fit.per_gpu,
                          "model_error": fit.residual_sd,
                          "excluded": fit.excluded}, indent=1))
        return 0
    print(f"wrote {out} (loss {fit.loss:.5g}; use: diffperf validate --efficiency {out})")
    print(format_table(ins, fit.cv.get(args.cv) if args.cv != "none" else None, args.cv))
    for line in held_lines:
        if line:
            print(line)
    if fit.excluded:
        ids = [e["id"] for e in fit.excluded]
        more = f" and {len(ids) - 10} more (--json lists them)" if len(ids) > 10 else ""
        print(f"rows left out (structurally infeasible or invalid): "
              f"{', '.join(ids[:10])}{more}")
    return 0


def source_groups(ds) -> set[str]:
    """The source groups (`_sources.source_of`) of a dataset's rows."""
    return {source_of(r) for r in ds.train_rows + ds.infer_rows}


def _holdout_path(arg: str | None, shipped: str, option: str, what: str) -> Path | None:
    """The held-out rows of `option` (`--moe-holdout`, `--infer-holdout`): the given file, the
    shipped `benchmarks_data/<shipped>` by default (None if this install has none), None for
    'none'."""
    if arg is not None and arg.strip().lower() == "none":
        return None
    if arg is None:
        path = benchmarks_dir() / shipped
        return path if path.is_file() else None
    if not Path(arg).is_file():
        raise ValueError(f"{option} {arg}: file not found (give a benchmark CSV of {what}, "
                         f"or 'none')")
    return Path(arg)


def format_table(ins: dict, cv: dict | None, cv_kind: str = "cv") -> str:
    """Plain-text MAPE table per metric / source / GPU (in-sample and, if given, CV)."""
    lines = []
    for key in ("metric", "source", "gpu", "imec"):
        lines.append(f"{'by ' + key:<32} {'n':>4} {'in-sample':>10}" + (
            f" {cv_kind + ' CV':>12}" if cv else ""))
        for name, s in ins[key].items():
            row = f"  {name:<30} {s['n']:>4} {s['mape']:>9.1f}%"
            if cv and name in cv.get(key, {}):
                row += f" {cv[key][name]['mape']:>11.1f}%"
            lines.append(row)
    return "\n".join(lines)
