"""The time of one iteration of an in-flight-batching engine: a mixed batch of prefill chunks
and decode tokens, from the same per-operation costs as `infer`.

An iteration runs one forward pass over `tokens` new tokens (decode tokens plus prompt chunk
tokens: every weight GEMM, element-wise kernel and collective sees all of them), the
attention of the decoders over their cached keys, the causal attention of the prompt chunks,
and the LM head on the `emitting` rows that sample a token. Its time is

    T = P(tokens) + H(emitting) + A_dec(decode_context) + A_pre(prefill_pairs, tokens)
        + launches(g) + host wait

- P(n): the pass without attention and LM head (GEMMs, element-wise, TP all-reduce, PP
  send/recv, embedding) over n tokens, and H(m): LM head, logits gather and sampling kernels
  for m rows. Both are evaluated exactly by `inference_ops`'s operation model on a geometric
  grid of token counts (`GRID_POINTS` points from 1 to the engine's token budget) and
  interpolated linearly between grid points (within 0.5 % of the exact cost at every token
  count in `tests/test_serving_iteration.py`): an engine iterates thousands of times per
  simulated request stream, and re-deriving every GEMM shape each time would cost ~50x more.
- A_dec(L) = a_dec L: a decode step's attention reads K and V of every cached key and its FLOPs
  are proportional to them, so (the smooth roofline being homogeneous of degree one) its time is
  exactly linear in the summed context L (keys read: min(context, window) in sliding-window
  layers, `Transformer.cached_tokens`).
- A_pre(q, n) = smax(c (q + q0), m n): the fused prefill attention's FLOPs and query tiles are
  proportional to the causal query-key pairs q of the chunks, and its Q / K / V / O traffic to
  their tokens; c and m are those of `infer`'s prefill attention at the deployment's typical
  prompt length (its kernel time per pair with the fixed time of its query tiles, and, with a
  sliding window, its share of the keys are taken at that length), and q0 its partial-wave
  loss (`diffperf.costs.prefill_attention_time`: a kernel of w waves of tiles takes (w + w0) /
  w times its busy time, so prompts alike take c (q + q0) with q0 = w0 SMs / tiles per pair),
  as `infer`'s for b such prompts. The
  traffic term counts all `tokens` of the iteration (decode tokens included: at most
  `max_num_seqs` tokens of Q / K / V / O, next to the chunks' pairs).
- launches(g): each kernel costs the eager launch (1 - g) or a CUDA-graph replay g, with
  g = `Runtime.decode_graph` for a decode-only iteration and `Runtime.prefill_graph` for one
  with prompt tokens, where the pass has at most `Runtime.graph_max_tokens` tokens
  (`graph_share`).
- padding: a decode-only iteration replayed from a graph of an engine that pads
  (`Runtime.graph_pad_ratio` > 1) runs P and H at the padded batch n + g (b_pad - n),
  b_pad = `graph_padded_batch(n)` on a ladder whose top is min(`graph_max_tokens`,
  `max_seqs`) (an executor pads to its max_batch_size where a listed size is larger): the
  empty slots pass through the weight GEMMs, the element-wise kernels and the LM head; they
  read no cache, so A_dec is unchanged. The grid reaches that top when it lies above the
  token budget (at most `graph_pad_ratio` x the budget), so that a padded batch stays on it.
- host wait: that of `infer` for one pass (`host_wait`): the engine's step time plus the
  host's issue time not hidden behind the GPU's.

Pipeline stages run one after another (all layers are on the critical path: an iteration's
time is the latency through the pipeline; micro-batches of different iterations do not
overlap), as `infer` does.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..costs._attention import prefill_wave_factor
from ..costs._cost import network_cost
from ..costs._roofline import exposed_after_overlap, smooth_max
from ..presets import resolve_efficiency
from ..specs._efficiency import Efficiency
from ..specs._hardware import System
from ..specs._inference_plan import InferencePlan
from ..specs._runtime import Runtime
from ..specs._transformer import Transformer
from ._host import graph_kernel_time, host_issue_time, host_scale, padded_size
from ._infer import (
    _decode_attention,
    _dims,
    _pass_ops,
    _prefill_activation_bytes,
    _prefill_attention,
    _prefill_attention_busy,
    weight_bytes_per_gpu,
)

#: Token counts at which the pass is evaluated exactly: geometric from 1 to the token budget.
GRID_POINTS = 64
#: Operations of a pass that run on the sampling rows only (their cost is H(emitting)).
HEAD_OPS = ("lm_head", "logits_gather", "final")


class IterationCost(eqx.Module):
    """Per-deployment coefficients of one engine iteration's time (module docstring). Times s,
    token counts in tokens; arrays of the grid have `GRID_POINTS` entries."""

    grid: jax.Array  # token counts of the grid
    body: jax.Array  # P(n) without launches: roofline + network time on the grid
    body_launch: jax.Array  # eager launch time of P(n)'s kernels on the grid
    body_kernels: jax.Array  # kernels of P(n) on the grid
    head: jax.Array  # H(m) without launches, m on the grid
    head_launch: jax.Array
    head_kernels: jax.Array
    decode_per_key: jax.Array  # a_dec: decode attention time per key read (all layers)
    decode_launch: jax.Array  # eager launch time of the decode attention kernels (all layers)
    decode_kernels: jax.Array
    prefill_per_pair: jax.Array  # c: prefill attention compute time per query-key pair
    prefill_wave_pairs: jax.Array  # q0: the kernel's partial-wave loss, as query-key pairs
    prefill_per_token: jax.Array  # m: prefill attention HBM time per token
    prefill_launch: jax.Array
    prefill_kernels: jax.Array
    replayed: jax.Array  # time of one kernel replayed from a CUDA graph
    prefill_graph: jax.Array
    decode_graph: jax.Array
    graph_max_tokens: jax.Array
    graph_pad_ratio: jax.Array  # CUDA-graph padding ladder (`graph_padded_batch`)
    graph_pad_from: jax.Array
    graph_pad_top: jax.Array  # the ladder's top: graph_max_tokens, capped at max_seqs
    host_issue: jax.Array  # host time to issue one eager pass
    host_step: jax.Array  # host time per iteration outside the layers
    host_seq: jax.Array  # host time per emitting sequence per iteration, beside the GPU
    pp: jax.Array
    sliding_window: jax.Array  # window of the windowed layers, tokens (0: none)
    windowed_fraction: jax.Array  # share of the layers that attend through it


def iteration_cost(model: Transformer, system: System, plan: InferencePlan, max_tokens,
                   efficiency: Efficiency | None = None,
                   runtime: Runtime | None = None, max_seqs=jnp.inf) -> IterationCost:
    """Build the iteration-time coefficients of serving `model` on `system` with `plan`'s
    parallelism and precisions, for iterations of up to `max_tokens` tokens (the engine's
    token budget) and `max_seqs` sequences (the engine's `max_num_seqs`: the top of a padding
    runtime's graph ladder; default no cap). `plan.input_len` and `plan.output_len` are the
    typical prompt and output lengths (they set the attention kernels' shapes); `plan.batch`
    is not used. Pure JAX (jit / vmap / grad)."""
    eff = resolve_efficiency(efficiency)
    runtime = Runtime() if runtime is None else runtime
    x = _dims(model, plan)
    padding = runtime.graph_pad_ratio > 1.0
    pad_top = jnp.where(padding, jnp.minimum(runtime.graph_max_tokens, max_seqs),
                        runtime.graph_max_tokens)
    budget = jnp.maximum(max_tokens, 1.0)
    # a padded decode batch (<= the budget) reaches at most min(ratio x budget, pad_top); the
    # grid's positions carry no gradient of the ladder
    reach = jnp.where(padding, jnp.minimum(runtime.graph_pad_ratio * budget, pad_top), budget)
    top = budget * jax.lax.stop_gradient(jnp.maximum(reach / budget, 1.0))
    grid = jnp.exp(jnp.linspace(0.0, 1.0, GRID_POINTS) * jnp.log(top))
    zero = network_cost(jnp.zeros(()), 0.0)

    def at(n):
        ops = _pass_ops(model, eqx.tree_at(lambda p: p.batch, plan, n), system, eff, x, n,
                        zero, runtime)
        body = [c for k, c in ops.items() if k not in HEAD_OPS]
        head = [ops[k] for k in HEAD_OPS]
        part = lambda cs: (sum(c.roofline + c.network for c in cs),
                           sum(c.launch for c in cs), sum(c.kernels for c in cs))
        return part(body) + part(head)

    body, body_launch, body_kernels, head, head_launch, head_kernels = jax.vmap(at)(grid)
    layers = model.layers
    one = eqx.tree_at(lambda p: p.batch, plan, 1.0)
    dec = _decode_attention(model, one, system, eff, x, 1.0)
    s = plan.input_len
    pre = _prefill_attention(model, one, system, eff, x, runtime)
    pairs = 0.5 * s * s
    # a fused kernel's time without its partial-wave loss, and that loss as pairs: n prompts
    # of the typical length take (n + w0 SMs / tiles_1) x one prompt's busy time; the unfused
    # path (`plan.flash_attention` 0) has no such loss
    busy, tiles, _ = _prefill_attention_busy(model, one, system, eff, x, runtime)
    flash = plan.flash_attention > 0
    per_pair = jnp.where(flash, busy, pre.compute) / pairs
    wave_pairs = jnp.where(flash, pairs * (prefill_wave_factor(system.accelerator, tiles) - 1.0),
                           0.0)
    host = host_scale(eff, system.accelerator)
    return IterationCost(
        grid=grid, body=body, body_launch=body_launch, body_kernels=body_kernels, head=head,
        head_launch=head_launch, head_kernels=head_kernels,
        decode_per_key=layers * dec.roofline, decode_launch=layers * dec.launch,
        decode_kernels=layers * dec.kernels,
        prefill_per_pair=layers * per_pair, prefill_wave_pairs=wave_pairs,
        prefill_per_token=layers * pre.memory / s,
        prefill_launch=layers * pre.launch, prefill_kernels=layers * pre.kernels,
        replayed=graph_kernel_time(eff, runtime), prefill_graph=runtime.prefill_graph,
        decode_graph=runtime.decode_graph, graph_max_tokens=runtime.graph_max_tokens,
        graph_pad_ratio=runtime.graph_pad_ratio, graph_pad_from=runtime.graph_pad_from,
        graph_pad_top=pad_top,
        host_issue=host_issue_time(model, plan, runtime, 0.0, host),
        host_step=host * runtime.host_step_time, host_seq=host * runtime.host_seq_time,
        pp=plan.pp,
        sliding_window=model.sliding_window, windowed_fraction=model.windowed_fraction)


def keys_read(cost: IterationCost, context) -> jax.Array:
    """Keys a decode step reads at `context` tokens of context, mean over the layers:
    min(context, window) in the windowed layers (`Transformer.cached_tokens`), tokens."""
    w = jnp.where(cost.sliding_window > 0, cost.sliding_window, context)
    r = cost.windowed_fraction
    return (1.0 - r) * context + r * jnp.minimum(context, w)


def iteration_time(cost: IterationCost, tokens, emitting, decode_keys, prefill_pairs,
                   has_prefill) -> jax.Array:
    """Time of one iteration, s (module docstring).

    **Arguments:**

    - `tokens`: new tokens of the pass (decode tokens + prompt chunk tokens), >= 1.
    - `emitting`: rows that sample a token (decoders + prompts completed in this iteration).
    - `decode_keys`: keys the decoders read in all, summed over them (`keys_read` of each
      decoder's context); 0 when no decoder runs.
    - `prefill_pairs`: causal query-key pairs of the prompt chunks, sum of c (done + c / 2).
    - `has_prefill`: 1 if any prompt chunk runs, else 0.
    """
    base, issue = iteration_base(cost, tokens, emitting, decode_keys > 0, prefill_pairs,
                                 has_prefill)
    return time_with_keys(cost, base, issue, decode_keys)


def iteration_base(cost: IterationCost, tokens, emitting, has_decode, prefill_pairs,
                   has_prefill) -> tuple[jax.Array, jax.Array]:
    """`(gpu, issue)`: the iteration's GPU time without the decoders' key reads, and the host
    time to issue its pass (its eager layers, and `Runtime.host_seq_time` per emitting
    sequence, which CUDA graphs do not remove), s (`iteration_time` = `time_with_keys` of
    them). Split so that iterations differing only in their keys share the rest."""
    n = jnp.maximum(tokens, 1.0)
    m = jnp.maximum(emitting, 1.0)
    graph = jnp.where(n <= cost.graph_max_tokens,  # as `graph_share`
                      jnp.where(has_prefill > 0, cost.prefill_graph, cost.decode_graph), 0.0)
    # a padded graph replay of a decode-only step runs the pass over the padded batch
    pad = jnp.where(has_prefill > 0, 0.0, graph) * (_padded(cost, n) - n)
    body, body_launch, body_kernels = _on_grid(cost, n + pad, (cost.body, cost.body_launch,
                                                               cost.body_kernels))
    head, head_launch, head_kernels = _on_grid(cost, m + pad, (cost.head, cost.head_launch,
                                                               cost.head_kernels))
    prefill = jnp.where(has_prefill > 0, smooth_max(
        cost.prefill_per_pair * (prefill_pairs + cost.prefill_wave_pairs),
        cost.prefill_per_token * n), 0.0)
    emits = emitting > 0
    eager = (body_launch + jnp.where(emits, head_launch, 0.0)
             + jnp.where(has_decode, cost.decode_launch, 0.0)
             + jnp.where(has_prefill > 0, cost.prefill_launch, 0.0))
    kernels = (body_kernels + jnp.where(emits, head_kernels, 0.0)
               + jnp.where(has_decode, cost.decode_kernels, 0.0)
               + jnp.where(has_prefill > 0, cost.prefill_kernels, 0.0))
    launch = (1.0 - graph) * eager + graph * kernels * cost.replayed
    gpu = body + jnp.where(emits, head, 0.0) + prefill + launch
    return gpu, (1.0 - graph) * cost.host_issue + cost.host_seq * emitting


def _padded(cost: IterationCost, n) -> jax.Array:
    """`graph_padded_batch` of n with the ladder stored in `cost`, sequences."""
    return padded_size(n, cost.graph_pad_ratio, cost.graph_pad_from, cost.graph_pad_top)


def _on_grid(cost: IterationCost, at, tables):
    """Each of `tables` (values on `cost.grid`) interpolated linearly at `at` tokens (clamped
    to the grid). The grid is geometric, so the interval is found in O(1): position
    log(at) / log(last) x (points - 1), not by a search."""
    g = cost.grid
    points = g.shape[-1]
    pos = jnp.log(at) / jnp.log(jnp.maximum(g[-1], 1.0 + 1e-6)) * (points - 1)
    i = jnp.clip(jnp.floor(pos).astype(jnp.int32), 0, points - 2)
    lo, hi = g[i], g[i + 1]
    w = jnp.clip((jnp.clip(at, g[0], g[-1]) - lo) / jnp.maximum(hi - lo, 1e-30), 0.0, 1.0)
    return tuple(t[i] + w * (t[i + 1] - t[i]) for t in tables)


def time_with_keys(cost: IterationCost, gpu, issue, decode_keys) -> jax.Array:
    """An iteration's time from `iteration_base`'s parts and the decoders' keys, s: GPU time
    plus the host's wait (the engine's step time and the issue time the GPU does not hide)."""
    gpu = gpu + cost.decode_per_key * decode_keys
    return gpu + cost.host_step + exposed_after_overlap(issue, gpu) / cost.pp


def kv_bytes_per_token(model: Transformer, plan: InferencePlan) -> jax.Array:
    """KV-cache bytes one token of context takes on one GPU (its pipeline stage's layers):
    layers / pp * (K and V elements per token and layer) * KV bytes per element, B."""
    x = _dims(model, plan)
    return model.layers / plan.pp * x.cache * x.kb


def kv_capacity_tokens(model: Transformer, system: System, plan: InferencePlan, max_tokens,
                       max_seqs, kv_memory_fraction, efficiency: Efficiency | None = None
                       ) -> jax.Array:
    """KV-cache tokens one replica holds: `kv_memory_fraction` of the HBM left after the
    weights, the workspace (`Efficiency.memory_reserve`) and the transient activations of a
    full iteration (`max_tokens` tokens, fp32 logits of `max_seqs` rows), divided by
    `kv_bytes_per_token`, tokens (0 when the weights alone do not fit)."""
    eff = resolve_efficiency(efficiency)
    per_token, scores, logits = _prefill_activation_bytes(model, plan)
    activations = max_tokens * per_token + max_seqs * logits
    free = (system.accelerator.hbm_capacity - weight_bytes_per_gpu(model, plan)
            - eff.memory_reserve - activations)
    return jnp.maximum(jnp.floor(kv_memory_fraction * free / kv_bytes_per_token(model, plan)),
                       0.0)
