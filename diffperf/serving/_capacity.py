"""The KV-cache tokens one engine replica holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..inference._iteration import kv_capacity_tokens
from ..specs._efficiency import Efficiency
from ..specs._engine import Engine
from ..specs._hardware import System
from ..specs._inference_plan import InferencePlan
from ..specs._transformer import Transformer


def replica_kv_tokens(model: Transformer, system: System, plan: InferencePlan, engine: Engine,
                      eff: Efficiency, max_seqs=None) -> jax.Array:
    """KV-cache tokens of one replica: `engine.kv_cache_tokens` where the engine sets it (> 0),
    else `kv_memory_fraction` of the HBM left after the weights, the workspace and a full
    iteration's activations (`diffperf.inference.kv_capacity_tokens`, at the engine's token
    budget and `max_seqs` rows, by default `engine.max_num_seqs`), tokens."""
    seqs = engine.max_num_seqs if max_seqs is None else max_seqs
    from_memory = kv_capacity_tokens(model, system, plan, engine.max_num_batched_tokens, seqs,
                                     engine.kv_memory_fraction, eff)
    return jnp.where(engine.kv_cache_tokens > 0, engine.kv_cache_tokens, from_memory)
