"""The KV-cache tokens one engine replica holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..inference._infer import weight_bytes_per_gpu
from ..inference._iteration import kv_bytes_per_token, kv_capacity_tokens
from ..specs._efficiency import Efficiency
from ..specs._engine import Engine
from ..specs._hardware import System
from ..specs._inference_plan import InferencePlan
from ..specs._transformer import Transformer


def set_cache_fits(model: Transformer, system: System, plan: InferencePlan,
                   engine: Engine) -> jax.Array:
    """Whether a cache set directly (`engine.kv_cache_tokens`) fits beside the weights on
    each GPU: kv_cache_tokens x `kv_bytes_per_token` <= HBM - weights (bool; activations and
    workspace left out, so only an impossible setting fails)."""
    need = engine.kv_cache_tokens * kv_bytes_per_token(model, plan)
    return need <= system.accelerator.hbm_capacity - weight_bytes_per_gpu(model, plan)


def replica_kv_tokens(model: Transformer, system: System, plan: InferencePlan, engine: Engine,
                      eff: Efficiency, max_seqs=None) -> jax.Array:
    """KV-cache tokens of one replica, tokens: `engine.kv_cache_tokens` where the engine sets
    it (> 0) and it fits beside the weights (`set_cache_fits`; 0 where it does not: no request
    is ever admitted, so a search drops that deployment and `serve` refuses it), else
    `kv_memory_fraction` of the HBM left after the weights, the workspace and a full
    iteration's activations (`diffperf.inference.kv_capacity_tokens`, at the engine's token
    budget and `max_seqs` rows, by default `engine.max_num_seqs`)."""
    seqs = engine.max_num_seqs if max_seqs is None else max_seqs
    from_memory = kv_capacity_tokens(model, system, plan, engine.max_num_batched_tokens, seqs,
                                     engine.kv_memory_fraction, eff)
    set_cache = jnp.where(set_cache_fits(model, system, plan, engine), engine.kv_cache_tokens,
                          0.0)
    return jnp.where(engine.kv_cache_tokens > 0, set_cache, from_memory)
