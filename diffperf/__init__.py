"""diffperf: a differentiable, JAX-accelerated performance model of distributed LLM training
and inference, after Kundu et al., IISWC 2024 (arXiv:2407.14645).

The names below are the stable API. The subpackages group the rest by what a user does:
`specs` (what is modelled), `presets`, `costs` (kernels, GEMMs, collectives), `training`,
`inference`, `serving` (an engine's scheduler under load, xPyD, SLO sizing), `explore`
(sweeps, plan search, what-if), `design` (technology, attribution, sensitivity, co-design),
`validation`, `calibrate`, `plots` and `cli`; `internal` holds helpers for the tests and the
calibration scripts, with no stability promise.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # every public name is imported on first use, by `__getattr__` below
    from .explore import (
        Grid,
        default_training_grid,
        evaluate_all,
        pareto_front,
        run_sweep,
        search_inference,
        search_training,
    )
    from .feasibility import REASONS, explain
    from .inference import (
        HBM_GENERATIONS,
        InferenceMemory,
        InferenceReport,
        boundedness,
        dram_scaling,
        experts_touched,
        infer,
        inference_memory,
        kv_cache_bytes_per_gpu,
        max_batch,
        weight_bytes_per_gpu,
    )
    from .plots import roofline_plot
    from .presets import (
        default_efficiency,
        efficiency_from_json,
        gpu,
        gpu_names,
        model,
        model_names,
        runtime,
        runtime_names,
        system,
        system_names,
    )
    from .specs import (
        Accelerator,
        Efficiency,
        InferencePlan,
        Network,
        Runtime,
        System,
        TrainingPlan,
        Transformer,
        matmul_efficiency,
        precision_code,
        transformer_from_hf_config,
    )
    from .training import (
        TrainingDetail,
        TrainingMemory,
        TrainingReport,
        activation_bytes_per_layer,
        model_flops_per_step,
        predict_training,
        train_step,
        training_detail,
        training_memory,
    )

__version__ = "0.1.0"

#: Public name -> the subpackage that defines it. Every name is imported on first use
#: (`diffperf.Transformer`, `from diffperf import Grid`): `import diffperf` loads no JAX, so
#: the command line's client (`diffperf.cli.main`) can hand a command to a running
#: `diffperf daemon` in a tenth of a second; one prediction imports what it needs.
_LAZY = {
    **dict.fromkeys(("Grid", "default_training_grid", "evaluate_all", "pareto_front",
                     "run_sweep", "search_inference", "search_training"), "explore"),
    **dict.fromkeys(("REASONS", "explain"), "feasibility"),
    **dict.fromkeys(("HBM_GENERATIONS", "InferenceMemory", "InferenceReport", "boundedness",
                     "dram_scaling", "experts_touched", "infer", "inference_memory",
                     "kv_cache_bytes_per_gpu", "max_batch", "weight_bytes_per_gpu"),
                    "inference"),
    "roofline_plot": "plots",
    **dict.fromkeys(("default_efficiency", "efficiency_from_json", "gpu", "gpu_names", "model",
                     "model_names", "runtime", "runtime_names", "system", "system_names"),
                    "presets"),
    **dict.fromkeys(("Accelerator", "Efficiency", "InferencePlan", "Network", "Runtime",
                     "System", "TrainingPlan", "Transformer", "matmul_efficiency",
                     "precision_code", "transformer_from_hf_config"), "specs"),
    **dict.fromkeys(("TrainingDetail", "TrainingMemory", "TrainingReport",
                     "activation_bytes_per_layer", "model_flops_per_step", "predict_training",
                     "train_step", "training_detail", "training_memory"), "training"),
}
#: Subpackages reachable as attributes (`diffperf.specs`) without importing them first.
_SUBPACKAGES = ("calibrate", "cli", "costs", "design", "explore", "feasibility", "inference",
                "internal", "plots", "presets", "serving", "specs", "training", "validation")


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # once: later look-ups do not come here
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Accelerator", "Efficiency", "Grid", "HBM_GENERATIONS", "InferenceMemory", "InferencePlan",
    "InferenceReport", "Network", "REASONS", "Runtime", "System", "TrainingDetail",
    "TrainingMemory", "TrainingPlan", "TrainingReport", "Transformer",
    "activation_bytes_per_layer", "boundedness",
    "default_efficiency", "default_training_grid", "dram_scaling", "efficiency_from_json",
    "evaluate_all", "experts_touched", "explain", "gpu", "gpu_names", "infer", "inference_memory",
    "kv_cache_bytes_per_gpu", "matmul_efficiency", "max_batch", "model", "model_flops_per_step",
    "model_names", "pareto_front", "precision_code", "predict_training", "roofline_plot",
    "run_sweep", "runtime", "runtime_names", "search_inference", "search_training", "system",
    "system_names", "train_step", "training_detail", "training_memory",
    "transformer_from_hf_config",
    "weight_bytes_per_gpu",
]
