"""A serving engine's scheduler settings: request slots, token budget, chunked prefill, policy,
KV-cache blocks (the contract: docs/serving.md, "Scheduler semantics")."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax

from .._checks import (
    check_choice,
    check_fraction,
    check_integer,
    check_nonnegative,
    named_code,
    names_number_fields,
    number_field as _F,
)

#: Scheduling policies: which work an iteration runs first (`Engine.policy`).
POLICIES = {"decode_first": 0, "prefill_first": 1}


@names_number_fields
class Engine(eqx.Module):
    """Scheduler of one engine replica (continuous / in-flight batching). Every field is an
    array leaf, so a sweep can vmap over engine settings.

    **Arguments:**

    - `max_num_seqs`: request slots, the most requests running at once (vLLM
      `max_num_seqs`, SGLang `max_running_requests`, TensorRT-LLM `max_batch_size`), count.
    - `max_num_batched_tokens`: token budget of one iteration, decode tokens plus prefill
      chunk tokens (vLLM `max_num_batched_tokens`, SGLang `chunked_prefill_size`,
      TensorRT-LLM `max_num_tokens`), count; at least `max_num_seqs`.
    - `chunked_prefill`: 1 if a prompt may be split over iterations, 0 if its remaining
      tokens are scheduled whole or not at all.
    - `policy`: 0 (`"decode_first"`): running decodes first, prefill chunks fill the rest of
      the budget (vLLM V1, TensorRT-LLM); 1 (`"prefill_first"`): an iteration with prompt
      tokens pending runs prefill only (SGLang, vLLM V0).
    - `block_size`: KV-cache block, tokens; KV is held in whole blocks.
    - `kv_output_reserve`: share r of a request's remaining output tokens it holds in the KV
      cache ahead of generating them, 0-1. Admission needs the blocks of what the new request
      holds on top of what the running ones hold, ceil((I + g + r (O - g)) / block) blocks
      each (g tokens generated). 1: the whole context reserved at admission (TensorRT-LLM's
      GUARANTEED_NO_EVICT); 0: blocks allocated as the context grows (vLLM's PagedAttention,
      LMDeploy TurboMind); SGLang admits against its running requests' remaining outputs times
      a ratio that decays to 0.098. Below 1 the contexts can outgrow the cache, where the
      engine would preempt; preemption is not modelled (a running request keeps its cache),
      and `Schedule.kv_peak` reports the most the contexts filled.
    - `kv_memory_fraction`: share of the HBM left after weights, workspace and the activations
      of a full iteration that the engine gives to the KV cache (vLLM
      `gpu_memory_utilization` is a share of the whole HBM instead; the preset converts), 0-1.
    - `kv_cache_tokens`: KV-cache tokens of one replica set directly (an engine configured
      with a block count: LMDeploy TurboMind's `cache_max_entry_count` above 1 times
      `cache_block_seq_len`), tokens; 0 (default): from `kv_memory_fraction`.
    - `context_pass`: 0 (default): an iteration is one forward pass over its decode tokens
      and prompt chunks together. 1: the FasterTransformer scheme (LMDeploy TurboMind up to
      v0.1.0a1): the iteration first runs its prompt tokens, each prompt but its last token,
      as a forward pass of their own (the context decoder), then one decode pass over the
      running requests and the prompts just completed, whose last token it processes and
      whose first output token it samples; each pass reads the weights once, so a prompt's
      first token costs a context pass plus a decode pass.
    """

    max_num_seqs: jax.Array = _F(default=256)
    max_num_batched_tokens: jax.Array = _F(default=8192)
    chunked_prefill: jax.Array = _F(default=1)
    policy: jax.Array = eqx.field(converter=named_code("Engine", "policy", POLICIES), default=0)
    block_size: jax.Array = _F(default=32)
    kv_memory_fraction: jax.Array = _F(default=0.9)
    kv_output_reserve: jax.Array = _F(default=1.0)
    kv_cache_tokens: jax.Array = _F(default=0.0)
    context_pass: jax.Array = _F(default=0.0)

    def __check_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            check_integer("Engine", name, getattr(self, name))
        check_choice("Engine", "chunked_prefill", self.chunked_prefill, {0: "off", 1: "on"})
        check_choice("Engine", "policy", self.policy, {v: k for k, v in POLICIES.items()})
        check_choice("Engine", "context_pass", self.context_pass, {0: "off", 1: "on"})
        check_nonnegative("Engine", "kv_cache_tokens", self.kv_cache_tokens)
        check_fraction("Engine", "kv_output_reserve", self.kv_output_reserve, allow_zero=True)
        check_fraction("Engine", "kv_memory_fraction", self.kv_memory_fraction,
                       allow_zero=False)


#: Every `Engine` field, in declaration order (for copying or printing an engine).
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(Engine))
