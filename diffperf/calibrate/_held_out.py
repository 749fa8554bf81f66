"""Model errors measured where the fit never looked: rows of held-out tables (MoE training
runs, inference on other GPUs, precisions or wider MoE models), predicted with a saved fit,
join the residuals its error model is fitted on (`_error_data.add_held_out`)."""

from __future__ import annotations

from pathlib import Path

from ..presets import efficiency_from_json
from ..validation._validate import validate
from ._error_data import add_held_out


def measure_held_out(fit, holdout: Path, holdout_rows, fitted_path: Path,
                     validated: list[dict] | None = None) -> str | None:
    """Add the residuals of the rows of `holdout` (parsed: `holdout_rows`) that `fit` was not
    fitted to, predicted with the saved fit at `fitted_path` (or given: `validated`, the
    `validate(...)["rows"]` of that file with that fit), to its error model; records how in
    the metadata (also used by `calibration/refit.py`). **Returns:** the line to print (None
    when no row of the file is held out)."""
    fitted_ids = {p["id"] for p in fit.predictions}
    rows = [r for r in holdout_rows if r.id not in fitted_ids]
    if not rows:
        return None
    if validated is None:
        validated = validate([holdout], efficiency_from_json(fitted_path))["rows"]
    added = add_held_out(fit, validated, rows)
    if not added:
        return None
    fit.metadata.setdefault("held_out_error_files", []).append(holdout.name)
    return (f"{added} held-out measurements of {holdout.name} join the residuals of the "
            f"interval error model ({fit.metadata['error_model_basis']})")
