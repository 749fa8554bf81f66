"""diffperf: a differentiable, JAX-accelerated performance model of distributed LLM training
and inference, after Kundu et al., IISWC 2024 (arXiv:2407.14645)."""

from .boundedness import HBM_GENERATIONS, boundedness, dram_scaling, roofline_plot
from .efficiency import Efficiency, matmul_efficiency
from .feasibility import REASONS, explain
from .hardware import Accelerator, Network, System, precision_code
from .grid import Grid
from .inference import (InferenceMemory, InferenceReport, experts_touched, infer,
                        inference_memory, kv_cache_bytes_per_gpu, max_batch, weight_bytes_per_gpu)
from .inference_plan import InferencePlan
from .hf_config import transformer_from_hf_config
from .model import Transformer
from .plans import TrainingPlan
from .presets import (default_efficiency, efficiency_from_json, gpu, gpu_names, model,
                      model_names, system, system_names)
from .search import default_training_grid, search_training
from .search_inference import search_inference
from .sweep import evaluate_all, pareto_front, run_sweep
from .training import TrainingReport, model_flops_per_step, predict_training, train_step
from .training_memory import TrainingMemory, activation_bytes_per_layer, training_memory

__version__ = "0.1.0"

__all__ = [
    "Accelerator", "Efficiency", "Grid", "HBM_GENERATIONS", "InferenceMemory", "InferencePlan",
    "InferenceReport", "Network", "REASONS", "System", "TrainingMemory", "TrainingPlan",
    "TrainingReport", "Transformer", "activation_bytes_per_layer", "boundedness",
    "default_efficiency", "default_training_grid", "dram_scaling", "efficiency_from_json",
    "evaluate_all", "experts_touched", "explain", "gpu", "gpu_names", "infer", "inference_memory",
    "kv_cache_bytes_per_gpu", "matmul_efficiency", "max_batch", "model", "model_flops_per_step",
    "model_names", "pareto_front", "precision_code", "predict_training", "roofline_plot",
    "run_sweep", "search_inference", "search_training", "system", "system_names", "train_step",
    "training_memory", "transformer_from_hf_config", "weight_bytes_per_gpu",
]
