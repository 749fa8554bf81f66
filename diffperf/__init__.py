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

if TYPE_CHECKING:  # imported on first use, by `__getattr__` below
    from .explore import (
        Grid,
        default_training_grid,
        evaluate_all,
        pareto_front,
        run_sweep,
        search_inference,
        search_training,
    )
    from .plots import roofline_plot

__version__ = "0.1.0"

#: Public names imported on first use (`diffperf.search_training`, `from diffperf import Grid`):
#: the sweeps, searches and plots load modules (and through them pandas, the calibration, the
#: validation) that one prediction does not need; `import diffperf` stays about 0.3 s shorter.
_LAZY = {"Grid": "explore", "default_training_grid": "explore", "evaluate_all": "explore",
         "pareto_front": "explore", "run_sweep": "explore", "search_inference": "explore",
         "search_training": "explore", "roofline_plot": "plots"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # once: later look-ups do not come here
        return value
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
