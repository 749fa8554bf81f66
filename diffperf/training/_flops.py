"""FLOPs of one optimizer step, whole job: model FLOPs (the MFU numerator) and hardware FLOPs
(with the recomputed forward passes, the HFU numerator), FLOP."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..specs._training_plan import TrainingPlan
from ..specs._transformer import Transformer


def _layer_flops_per_token(model: Transformer) -> tuple[jax.Array, jax.Array]:
    """Forward FLOPs per token of one layer: (weight GEMMs, attention core at full s x s).

    Weight GEMMs: 2 FLOPs per active weight. Attention: QK^T and AV, 2 * 2 * s * a * d per token
    (a * d = h unless the model sets `head_width`; 2 s a (d_qk + d_v) with MLA's widths;
    Megatron / Korthikanti convention: the
    causal mask is not discounted). Sliding-window layers count their causal band in the same
    convention (`Transformer.attended_keys`).
    """
    h = model.hidden
    r = model.dense_fraction  # MoE models' dense-MLP layers
    moe_mlp = (model.mlp_matrices * h * (model.experts_per_token * model.ffn_hidden
                                         + model.shared_ffn_hidden)
               + jnp.where(model.num_experts > 1, h * model.num_experts, 0.0))
    active = (model.attention_weights()
              + (1.0 - r) * moe_mlp + r * model.mlp_matrices * h * model.dense_width)
    core = 2.0 * model.attended_keys(model.seq_len) * model.heads * (model.qk_dim + model.v_dim)
    return 2.0 * active, core


def model_flops_per_step(model: Transformer, plan: TrainingPlan,
                         causal_attention: bool = False) -> jax.Array:
    """Model FLOPs of one step, whole job (forward + backward = 3x forward, no recomputation).

    For GPT (ffn 4h, MHA) this is Korthikanti's 72 B s L h^2 (1 + s/(6h) + V/(12 h L)).
    `causal_attention=True` halves the attention-core term (the convention of some vendor
    tables, e.g. Megatron-Bridge); the default counts the full s x s product (Megatron, NeMo).
    """
    gemm, attn = _layer_flops_per_token(model)
    if causal_attention:
        attn = 0.5 * attn
    per_token = 3.0 * (model.layers * (gemm + attn) + 2.0 * model.hidden * model.vocab)
    return plan.global_batch * model.seq_len * per_token


def _module_gemm_flops_per_token(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """Forward GEMM FLOPs per token of one layer that selective module recomputation reruns:
    MLA's query and KV up-projections (`recompute_mla_up`: 2 a (q_in d_qk + c_kv (d + d_v)),
    q_in the query latent, or h where the queries are projected from h directly, which
    Megatron-core reruns in the same checkpoint) and the dense MLPs (`recompute_mlp`: 2 m h f
    of a dense model, the dense-MLP layers' share r of 2 m h f_d in a MoE model)."""
    h, r = model.hidden, model.dense_fraction
    q_in = jnp.where(model.q_lora_rank > 0, model.q_lora_rank, h)
    mla_up = 2.0 * model.mla * model.heads * (q_in * model.qk_dim + model.kv_lora_rank
                                              * (model.head_dim + model.v_dim))
    dense_model = jnp.where(model.num_experts > 1, 0.0, 1.0 - r)
    mlp = 2.0 * model.mlp_matrices * h * (dense_model * model.ffn_hidden
                                          + r * model.dense_width)
    return plan.recompute_mla_up * mla_up + plan.recompute_mlp * mlp


def hardware_flops_per_step(model: Transformer, plan: TrainingPlan) -> jax.Array:
    """Model FLOPs plus the recomputed forward: the whole layer (full or `recompute_layers`,
    Narayanan's Eq. 3 for full:
    96 B s L h^2 (1 + s/(6h) + V/(16 L h))) or the attention core (selective, unfused attention
    only: a flash kernel's own recomputation is part of its backward pass, not counted here),
    and on the other layers the GEMMs of recomputed modules (`_module_gemm_flops_per_token`)."""
    gemm, attn = _layer_flops_per_token(model)
    selective = jnp.where(plan.flash_attention > 0, 0.0, attn)  # flash: inside its backward
    full = plan.recomputed_fraction(model.layers)  # incl. `recompute_layers` (block method)
    extra = full * (gemm + attn) + (1.0 - full) * (
        jnp.where(plan.recompute == 1, selective, 0.0)
        + _module_gemm_flops_per_token(model, plan))
    tokens = plan.global_batch * model.seq_len
    return model_flops_per_step(model, plan) + tokens * model.layers * extra
