"""Local sizes of one training GPU: activation width, tokens per micro-batch, expert tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..costs._roofline import bytes_per_element
from ..specs._training_plan import TrainingPlan
from ..specs._transformer import Transformer


def activation_bytes(precision) -> jax.Array:
    """Bytes per activation element: 16 bit even in fp8 / fp4 recipes, 4 in fp32 training."""
    return jnp.maximum(bytes_per_element(precision), 2.0)


def local_tokens(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """Tokens of one micro-batch on one GPU: micro_batch * seq_len / cp (each context-parallel
    rank holds seq_len / cp query tokens per sequence)."""
    return plan.micro_batch * (model.seq_len / plan.cp)


def expert_tokens(model: Transformer, plan: TrainingPlan) -> tuple[jax.Array, jax.Array]:
    """`(etp, moe_tokens)`: the expert layers' tensor-parallel degree and the tokens its group
    dispatches from one GPU, tokens * etp / tp.

    Expert layers (`TrainingPlan.expert_layout`): an expert-tensor-parallel group of etp ranks
    dispatches its tokens (each rank holds tokens / t under sequence parallelism; all of them
    when etp = t) to the ep ranks of its experts; each local expert runs an f / etp slice."""
    etp = plan.expert_layout(model)[0]
    return etp, local_tokens(model, plan) * etp / plan.tp
