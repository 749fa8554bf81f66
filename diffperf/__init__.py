"""diffperf: a differentiable, JAX-accelerated performance model of distributed LLM training
and inference, after Kundu et al., IISWC 2024 (arXiv:2407.14645).

The names below are the stable API. The subpackages group the rest by what a user does:
`specs` (what is modelled), `presets`, `costs` (kernels, GEMMs, collectives), `training`,
`inference`, `explore` (sweeps, plan search, what-if), `design` (technology, attribution,
sensitivity, co-design), `validation`, `calibrate`, `plots` and `cli`; `internal` holds helpers
for the tests and the calibration scripts, with no stability promise.
"""

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
    TrainingMemory,
    TrainingReport,
    activation_bytes_per_layer,
    model_flops_per_step,
    predict_training,
    train_step,
    training_memory,
)

__version__ = "0.1.0"

__all__ = [
    "Accelerator", "Efficiency", "Grid", "HBM_GENERATIONS", "InferenceMemory", "InferencePlan",
    "InferenceReport", "Network", "REASONS", "Runtime", "System", "TrainingMemory", "TrainingPlan",
    "TrainingReport", "Transformer", "activation_bytes_per_layer", "boundedness",
    "default_efficiency", "default_training_grid", "dram_scaling", "efficiency_from_json",
    "evaluate_all", "experts_touched", "explain", "gpu", "gpu_names", "infer", "inference_memory",
    "kv_cache_bytes_per_gpu", "matmul_efficiency", "max_batch", "model", "model_flops_per_step",
    "model_names", "pareto_front", "precision_code", "predict_training", "roofline_plot",
    "run_sweep", "runtime", "runtime_names", "search_inference", "search_training", "system",
    "system_names", "train_step", "training_memory", "transformer_from_hf_config",
    "weight_bytes_per_gpu",
]
