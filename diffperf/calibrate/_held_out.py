"""Model errors measured where the fit never looked: the held-out MoE training runs and the
held-out inference rows on other GPUs, precisions or wider MoE models, predicted with a saved
fit, become the interval floors `step_time_moe`, `infer_unseen` and `infer_moe`."""

from __future__ import annotations

from pathlib import Path

from ..presets import efficiency_from_json
from ..validation._validate import validate
from ._uncertainty import (
    MOE_INFERENCE,
    MOE_STEP_TIME,
    UNSEEN_INFERENCE,
    moe_inference_error,
    moe_step_error,
    training_quantity,
    unseen_inference_error,
)


def measure_inference_errors(fit, holdout: Path, holdout_rows, fitted_path: Path,
                             validated: list[dict] | None = None) -> dict:
    """Set `fit`'s unseen-inference and MoE-inference errors (`unseen_inference_error`,
    `moe_inference_error`) from the inference rows of `holdout` (parsed: `holdout_rows`) it was
    not fitted to, predicted with the saved fit at `fitted_path` (or given: `validated`, the
    `validate(...)["rows"]` of that file with that fit); records how in the metadata (also
    used by `calibration/refit.py` and `diffperf calibrate`). **Returns:** `{"lines": lines to
    print, "unseen": ..., "moe": ...}` (the two functions' results)."""
    fitted_ids = {r.id for r in fit.problem.ds.infer_rows}
    rows = [r for r in holdout_rows if r.kind == "infer" and r.id not in fitted_ids]
    if validated is None and rows:
        validated = validate([holdout], efficiency_from_json(fitted_path))["rows"]
    result = validated if rows else []
    unseen = unseen_inference_error(fit, result, rows)
    moe = moe_inference_error(fit, result, rows)
    lines = []
    if UNSEEN_INFERENCE in fit.residual_sd:
        how = (f"{unseen['unseen']} held-out inference rows of {holdout.name} on other GPUs "
               f"or GEMM precisions")
        fit.metadata["unseen_inference_error_basis"] = how
        lines.append(f"inference outside the fitted data (GPUs "
                     f"{', '.join(fit.inference_support['gpus'])}): model error "
                     f"{fit.residual_sd[UNSEEN_INFERENCE] * 100:.1f} %, from {how}; "
                     f"`diffperf infer --interval` uses it there")
    if MOE_INFERENCE in fit.residual_sd:
        most = fit.inference_support["max_experts"]
        which = (f"MoE models with more than {most} experts per layer" if most > 1 else
                 "MoE models (no fitted inference row is of one)")
        how = f"{moe['held_out']} held-out inference rows of {holdout.name} of {which}"
        fit.metadata["moe_inference_error_basis"] = how
        lines.append(f"inference of {which}: model error "
                     f"{fit.residual_sd[MOE_INFERENCE] * 100:.1f} %, from {how}; "
                     f"`diffperf infer --interval` uses it there")
    return {"lines": lines, "unseen": unseen, "moe": moe}


def measure_moe_step_error(fit, holdout: Path, holdout_rows, fitted_path: Path,
                       fitted_predictions: list[dict], basis: str) -> str | None:
    """Set `fit`'s MoE training error (`moe_step_error`) from its MoE rows and the MoE runs of
    `holdout` (parsed: `holdout_rows`) it was not fitted to, predicted with the saved fit at
    `fitted_path`; records how in the metadata. **Returns:** the line to print (None when there
    is no MoE measurement)."""
    fitted_ids = {r.id for r in fit.problem.ds.train_rows}
    moe_ids = {r.id for r in holdout_rows
               if r.kind == "train" and r.id not in fitted_ids
               and training_quantity(r.values["num_experts"]) == MOE_STEP_TIME}
    result = validate([holdout], efficiency_from_json(fitted_path))
    moe = moe_step_error(fit, fitted_predictions,
                         [row for row in result["rows"] if row["id"] in moe_ids])
    if MOE_STEP_TIME not in fit.residual_sd:
        return None
    basis = (f"{moe['fitted']} fitted MoE rows ({basis}) and {moe['held_out']} held-out MoE "
             f"runs of {holdout.name}")
    fit.metadata["moe_error_basis"] = basis
    sd, dense = fit.residual_sd[MOE_STEP_TIME], fit.residual_sd.get("step_time")
    versus = f" (all training steps: {dense * 100:.1f} %)" if dense is not None else ""
    return (f"MoE training steps: model error {sd * 100:.1f} %{versus}, from {basis}; "
            f"`diffperf train --interval` uses it for MoE models")
