"""diffperf: a differentiable, JAX-accelerated performance model of distributed LLM training
and inference, after Kundu et al., IISWC 2024 (arXiv:2407.14645)."""

from .efficiency import Efficiency, matmul_efficiency
from .feasibility import REASONS, explain
from .hardware import Accelerator, Network, System, precision_code
from .model import Transformer, transformer_from_hf_config
from .plans import TrainingPlan
from .presets import (default_efficiency, efficiency_from_json, gpu, gpu_names, model,
                      model_names, system, system_names)
from .training import TrainingReport, model_flops_per_step, train_step
from .training_memory import TrainingMemory, activation_bytes_per_layer, training_memory

__version__ = "0.1.0"

__all__ = [
    "Accelerator", "Efficiency", "Network", "REASONS", "System", "TrainingMemory", "TrainingPlan",
    "TrainingReport", "Transformer", "activation_bytes_per_layer", "default_efficiency",
    "efficiency_from_json", "explain", "gpu", "gpu_names", "matmul_efficiency", "model",
    "model_flops_per_step", "model_names", "precision_code", "system", "system_names",
    "train_step", "training_memory", "transformer_from_hf_config",
]
