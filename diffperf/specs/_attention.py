"""The weight GEMMs of one layer's attention block, per GPU: standard attention (MHA / GQA /
MQA: one fused QKV projection and the output projection) or multi-head latent attention (MLA,
DeepSeek-V2 / V3: queries and keys / values pass through low-rank latents).

MLA's shapes (DeepSeek-V2, Sec. 2.1): queries h -> q_lora_rank -> a (d_n + d_r) (or h -> a (d_n
+ d_r) directly without `q_lora_rank`); keys and values h -> kv_lora_rank + d_r (the latent
that is cached, and the decoupled RoPE key shared by all heads) -> a (d_n + d_v); output
a d_v -> h. Tensor parallelism splits the heads; the two down-projections are replicated on
every GPU of the group (Megatron-core's MLA). A decode step absorbs the key / value
up-projection into the query and the output: the same weights and FLOPs per new token as
up-projecting it, so the GEMMs below serve prefill and decode alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

if TYPE_CHECKING:  # _transformer.py derives its attention weight count from `projections`
    from ._transformer import Transformer


class Projection(NamedTuple):
    """One weight GEMM per token row: (rows x k) @ (k x n), per GPU, counted `share` times
    (0 where the model does not have it; a traced model may mix both kinds of attention)."""

    n: jax.Array
    k: jax.Array
    share: jax.Array
    is_output: bool  # the output projection (row-parallel); the others read the layer input


def projections(model: Transformer, tp) -> list[Projection]:
    """The attention block's weight GEMMs on one GPU of a `tp`-wide tensor-parallel group.

    A model whose `kv_lora_rank` is a concrete 0 (or > 0) gets only its own kind; a traced one
    gets both, weighted by `Transformer.mla`, with finite stand-in sizes for the absent kind."""
    h = model.hidden
    heads = model.heads / tp
    kv = jnp.maximum(model.kv_heads / tp, 1.0)  # KV heads are replicated when tp > kv_heads
    d = model.head_dim
    out = []
    if not model.known_present("kv_lora_rank"):
        std = 1.0 - model.mla
        out += [Projection((heads + 2.0 * kv) * d, h, std, False),
                Projection(h, heads * d, std, True)]
    if not model.known_absent("kv_lora_rank"):
        mla = model.mla
        has_q = jnp.where(model.q_lora_rank > 0, 1.0, 0.0)
        # without a query latent the query up-projection is the direct h -> a (d_n + d_r) one
        q_lora = jnp.where(model.q_lora_rank > 0, model.q_lora_rank, h)
        c_kv = jnp.where(model.kv_lora_rank > 0, model.kv_lora_rank, h)
        out += [Projection(q_lora, h, mla * has_q, False),  # query down (replicated)
                Projection(heads * model.qk_dim, q_lora, mla, False),  # query up (or direct)
                Projection(c_kv + model.rope_head_dim, h, mla, False),  # KV down (replicated)
                Projection(heads * (d + model.v_dim), c_kv, mla, False),  # KV up
                Projection(h, heads * model.v_dim, mla, True)]
    return out
