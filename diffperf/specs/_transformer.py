"""The transformer LLM being trained or served (architecture only, no parallelism)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._checks import (
    check_divides,
    check_fraction,
    check_integer,
    is_concrete,
    names_number_fields,
    number_field as _F,
)
from ._attention import projections

#: Optional sizes and counts (0 = the feature is absent or derived).
_OPTIONAL_SIZES = ("head_width", "sliding_window", "global_layers", "dense_layers",
                   "dense_ffn_hidden", "shared_ffn_hidden", "kv_lora_rank", "q_lora_rank",
                   "rope_head_dim", "v_head_dim")
_MOE = ("num_experts", 1, "a MoE model (num_experts > 1)")
_MLA = ("kv_lora_rank", 0, "multi-head latent attention (kv_lora_rank > 0)")
#: Fields that only mean something when another field exceeds a threshold.
_NEEDS = {"dense_layers": _MOE, "shared_ffn_hidden": _MOE, "expert_bias": _MOE,
          "q_lora_rank": _MLA,
          "rope_head_dim": _MLA, "v_head_dim": _MLA}


@names_number_fields
class Transformer(eqx.Module):
    """A decoder-only transformer. Every field is an array leaf so that `vmap` can batch models.

    **Arguments:**

    - `layers`: transformer blocks L.
    - `hidden`: model width h.
    - `heads`: attention (query) heads a.
    - `kv_heads`: key/value heads g (= a for MHA, < a for GQA, 1 for MQA).
    - `ffn_hidden`: MLP inner width f (per expert for MoE).
    - `vocab`: vocabulary size V.
    - `seq_len`: sequence length s in tokens (training context; inference sets its own lengths).
    - `gated_mlp`: 1 for a SwiGLU-style 3-matrix MLP, 0 for a 2-matrix GeLU MLP.
    - `num_experts`: E experts per MoE layer (1 = dense).
    - `experts_per_token`: top-k experts each token is routed to (1 = dense).
    - `parallel_attention`: 1 for a parallel block (GPT-J, GPT-NeoX, Falcon, PaLM) that adds the
      attention and MLP outputs of the same normalised input to the residual in one step: one
      tensor-parallel reduction per layer and pass instead of two; 0 for the sequential block.
    - `head_width`: per-head width d when it is not h / a (Gemma, Qwen3, Mistral-NeMo:
      the query and output projections are then a * d wide, not h); 0 (the default) = h / a.
    - `tied_embeddings`: 1 if the output head shares the input embedding's weights (GPT-2,
      Gemma, Llama 3.2 1B / 3B): one V x h matrix where a single GPU would hold both; 0 for
      separate matrices (Llama 2 / 3, Mistral).
    - `dropout`: 1 if training applies dropout (GPT-2 / GPT-3 / Megatron GPT: attention and
      hidden dropout, whose 1-byte masks are stored for the backward pass, Korthikanti et al.
      2022); 0 for dropout-free models (Llama, Mistral, Mixtral, Nemotron-4, GPT-J, Falcon),
      which store and write no masks. Affects training only.
    - `sliding_window`: keys a query attends to in a sliding-window layer (Mistral 7B v0.1,
      Gemma 2 / 3, gpt-oss): each query sees itself and the `sliding_window - 1` tokens
      before it, and those layers cache only that many tokens; 0 (the default) = every
      layer attends to the whole context.
    - `global_layers`: with a `sliding_window`, the layers that still attend to the whole
      context (Gemma 3: 1 in 6; Gemma 2, gpt-oss: every other one; Mistral: none).
    - `dense_layers`: in a MoE model, the layers whose MLP is one dense MLP instead of the
      experts (DeepSeek-MoE and GLM-4.5's first layers, Qwen-MoE's `mlp_only_layers`); 0 = all.
      Modelled as spread evenly over the pipeline stages.
    - `dense_ffn_hidden`: inner width of those dense MLPs; 0 (the default) = `ffn_hidden`.
    - `shared_ffn_hidden`: in the MoE layers, inner width of the shared-expert MLP that every
      token passes through besides its routed experts (DeepSeek-MoE: `n_shared_experts` x the
      expert width; Qwen-MoE: `shared_expert_intermediate_size`); 0 (the default) = none. Split
      over tp like a dense MLP, replicated over ep, never dispatched.
    - `kv_lora_rank`: multi-head latent attention (DeepSeek-V2 / V3, Kimi K2) when > 0: keys
      and values come from a latent of this width, which is what the KV cache holds (with
      the RoPE key); 0 (the default) = standard attention. With MLA `head_width` is the
      per-head query / key width without RoPE (`qk_nope_head_dim`).
    - `q_lora_rank`: MLA's query latent width (0 = queries projected from h directly).
    - `rope_head_dim`: MLA's decoupled RoPE key / query width per head (`qk_rope_head_dim`).
    - `v_head_dim`: MLA's value width per head; 0 = `head_width`.
    - `expert_bias`: 1 if the routed experts' linear layers carry biases (gpt-oss:
      `gate_up_proj_bias`, `down_proj_bias`); 0 (the default) = none. Training only: how
      Megatron-Core applies them is an operation of its own (`_layer.moe_eager_time`).
    - `glu_clamp`: 1 if the gated activation clamps its two inputs first (gpt-oss's
      `swiglu_limit`: the gate to at most 7, the linear half to +-7); 0 (the default) = none.
      Training only, as `expert_bias`.
    """

    layers: jax.Array = _F()
    hidden: jax.Array = _F()
    heads: jax.Array = _F()
    kv_heads: jax.Array = _F()
    ffn_hidden: jax.Array = _F()
    vocab: jax.Array = _F()
    seq_len: jax.Array = _F(default=2048)
    gated_mlp: jax.Array = _F(default=0)
    num_experts: jax.Array = _F(default=1)
    experts_per_token: jax.Array = _F(default=1)
    parallel_attention: jax.Array = _F(default=0)
    dropout: jax.Array = _F(default=1)
    head_width: jax.Array = _F(default=0)
    tied_embeddings: jax.Array = _F(default=0)
    sliding_window: jax.Array = _F(default=0)
    global_layers: jax.Array = _F(default=0)
    dense_layers: jax.Array = _F(default=0)
    dense_ffn_hidden: jax.Array = _F(default=0)
    shared_ffn_hidden: jax.Array = _F(default=0)
    kv_lora_rank: jax.Array = _F(default=0)
    q_lora_rank: jax.Array = _F(default=0)
    rope_head_dim: jax.Array = _F(default=0)
    v_head_dim: jax.Array = _F(default=0)
    expert_bias: jax.Array = _F(default=0)
    glu_clamp: jax.Array = _F(default=0)

    def __check_init__(self):
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len",
                     "num_experts", "experts_per_token"):
            check_integer("Transformer", name, getattr(self, name))
        for name in _OPTIONAL_SIZES:
            check_integer("Transformer", name, getattr(self, name), minimum=0)
        for name, (other, above, what) in _NEEDS.items():
            part, owner = getattr(self, name), getattr(self, other)
            if is_concrete(part, owner) and np.any((np.asarray(part) > 0)
                                                   & (np.asarray(owner) <= above)):
                raise ValueError(f"Transformer.{name} > 0 needs {what}")
        for name in ("global_layers", "dense_layers"):
            part = getattr(self, name)
            if is_concrete(part, self.layers):
                g, n = np.asarray(part), np.asarray(self.layers)
                if np.any(g > n):
                    raise ValueError(f"Transformer.{name}={float(np.max(g)):g} exceeds "
                                     f"layers={float(np.min(n)):g}")
        check_fraction("Transformer", "tied_embeddings", self.tied_embeddings)
        check_integer("Transformer", "tied_embeddings", self.tied_embeddings, minimum=0)
        check_fraction("Transformer", "gated_mlp", self.gated_mlp)
        check_integer("Transformer", "gated_mlp", self.gated_mlp, minimum=0)
        check_fraction("Transformer", "parallel_attention", self.parallel_attention)
        check_integer("Transformer", "parallel_attention", self.parallel_attention, minimum=0)
        check_fraction("Transformer", "dropout", self.dropout)
        check_integer("Transformer", "dropout", self.dropout, minimum=0)
        for name in ("expert_bias", "glu_clamp"):
            check_fraction("Transformer", name, getattr(self, name))
            check_integer("Transformer", name, getattr(self, name), minimum=0)
        if is_concrete(self.head_width, self.heads, self.hidden):
            # heads must divide hidden only where the head width is derived from it
            derived = np.asarray(self.head_width) == 0
            check_divides("Transformer", "heads", self.heads, "hidden",
                          np.where(derived, np.asarray(self.hidden), np.asarray(self.heads)))
        check_divides("Transformer", "kv_heads", self.kv_heads, "heads", self.heads)
        if is_concrete(self.experts_per_token, self.num_experts):
            k, e = np.asarray(self.experts_per_token), np.asarray(self.num_experts)
            if np.any(k > e):
                raise ValueError(f"Transformer.experts_per_token={float(np.max(k)):g} exceeds "
                                 f"num_experts={float(np.max(e)):g}")

    @property
    def head_dim(self) -> jax.Array:
        """Per-head width d: `head_width`, or h / a when that is 0."""
        return jnp.where(self.head_width > 0, self.head_width, self.hidden / self.heads)

    @property
    def attention_width(self) -> jax.Array:
        """Width a * d of the queries and of the output projection's input (= h unless
        `head_width` says otherwise; with MLA a * d_n, see `qk_dim` / `v_dim`)."""
        return self.heads * self.head_dim

    @property
    def mla(self) -> jax.Array:
        """1 for multi-head latent attention (`kv_lora_rank` > 0), else 0."""
        return jnp.where(self.kv_lora_rank > 0, 1.0, 0.0)

    def known_present(self, name: str) -> bool:
        """True when field `name` is concrete and nonzero for every model of a batch (the
        counterpart of `known_absent`)."""
        v = getattr(self, name)
        return is_concrete(v) and bool(np.all(np.asarray(v) != 0))

    @property
    def qk_dim(self) -> jax.Array:
        """Per-head query / key width in the attention kernel: d, or d_n + d_r with MLA."""
        return self.head_dim + self.mla * self.rope_head_dim

    @property
    def v_dim(self) -> jax.Array:
        """Per-head value width: `v_head_dim`, or the head width d."""
        return jnp.where(self.v_head_dim > 0, self.v_head_dim, self.head_dim)

    @property
    def attention_kv_heads(self) -> jax.Array:
        """K / V heads the attention kernel reads: `kv_heads`, or every query head with MLA
        (keys and values are up-projected per head)."""
        return jnp.where(self.kv_lora_rank > 0, self.heads, self.kv_heads)

    def attention_weights(self) -> jax.Array:
        """Weights of the attention projections of one layer (no biases / norms), count: the
        GEMMs of `diffperf.specs.projections` on one GPU."""
        return jnp.asarray(sum(pr.share * pr.n * pr.k for pr in projections(self, 1.0)))

    def kv_cache_width(self, tp) -> jax.Array:
        """Elements one GPU caches per token and layer: K and V of its max(kv_heads / tp, 1)
        heads, or MLA's latent and RoPE key (kv_lora_rank + rope_head_dim, on every GPU)."""
        standard = 2.0 * jnp.maximum(self.kv_heads / tp, 1.0) * self.head_dim
        return ((1.0 - self.mla) * standard
                + self.mla * (self.kv_lora_rank + self.rope_head_dim))

    def known_dense(self) -> bool:
        """True when `num_experts` is a concrete 1 for every model of a batch: the expert-layer
        terms then equal the dense ones and can be left out of the trace."""
        return is_concrete(self.num_experts) and bool(np.all(np.asarray(self.num_experts) <= 1))

    def known_absent(self, name: str) -> bool:
        """True when field `name` is a concrete zero (not a tracer): the model has no such
        layers, so the costs of that layer kind can be left out of the trace. (A traced or
        batched field keeps them: sweeps over it and gradients in it stay exact.)"""
        v = getattr(self, name)
        return is_concrete(v) and not np.any(np.asarray(v))

    @property
    def windowed_fraction(self) -> jax.Array:
        """Share of the layers that attend through the sliding window (0 without one)."""
        return jnp.where(self.sliding_window > 0, 1.0 - self.global_layers / self.layers, 0.0)

    def _window(self, tokens) -> jax.Array:
        """The window, or `tokens` where the model has none (so that min(tokens, w) = tokens)."""
        return jnp.where(self.sliding_window > 0, self.sliding_window, tokens)

    def attended_keys(self, tokens) -> jax.Array:
        """Keys per query of causal attention over `tokens` tokens, mean over the layers, in
        the full-square convention: `tokens` for full attention (the s x s product that FLOP
        counts use; the causal mask halves the work actually done). A window w < s keeps
        w (2 - w / s) of it: the causal band does w s - w^2 / 2 of the s^2 / 2 products."""
        if self.known_absent("sliding_window"):
            return tokens + 0.0 * self.sliding_window
        w = jnp.minimum(self._window(tokens), tokens)
        windowed = 2.0 * w - w * w / tokens
        r = self.windowed_fraction
        return (1.0 - r) * tokens + r * windowed

    def cached_tokens(self, context) -> jax.Array:
        """Tokens of K / V a layer holds, and a decode step reads, at `context` tokens of
        context, mean over the layers: min(context, window) in sliding-window layers."""
        r = self.windowed_fraction
        return (1.0 - r) * context + r * jnp.minimum(context, self._window(context))

    def mean_cached_tokens(self, start, end) -> jax.Array:
        """Mean of `cached_tokens(c)` over contexts c spread evenly from `start` to `end`
        (a decode that grows the context from the prompt to the last token): the integral of
        min(c, w) over [start, end] divided by end - start, mean over the layers."""
        w = self._window(end)
        clipped = jnp.clip(w, start, end)
        span = jnp.maximum(end - start, 1e-9)
        windowed = ((clipped * clipped - start * start) / 2.0 + w * (end - clipped)) / span
        windowed = jnp.where(end > start, windowed, jnp.minimum(start, w))
        r = self.windowed_fraction
        return (1.0 - r) * 0.5 * (start + end) + r * windowed

    @property
    def mlp_matrices(self) -> jax.Array:
        """Weight matrices per MLP (per expert): 3 for gated (SwiGLU), 2 otherwise."""
        return 2.0 + self.gated_mlp

    @property
    def tp_reductions_per_pass(self) -> jax.Array:
        """Tensor-parallel reductions per layer and pass: one after attention and one after
        the MLP, or one for the summed branches of a parallel attention + MLP block."""
        return 2.0 - self.parallel_attention

    @property
    def dense_fraction(self) -> jax.Array:
        """Share of the layers of a MoE model with a dense MLP (`dense_layers` / `layers`)."""
        return self.dense_layers / self.layers

    @property
    def shared_width(self) -> jax.Array:
        """`shared_ffn_hidden` where the model has a shared expert, else `ffn_hidden`: a
        width at which its GEMMs can be costed (then weighted by `has_shared`) without 0 / 0."""
        return jnp.where(self.shared_ffn_hidden > 0, self.shared_ffn_hidden, self.ffn_hidden)

    @property
    def has_shared(self) -> jax.Array:
        """1 if the MoE layers have a shared expert, else 0."""
        return jnp.where(self.shared_ffn_hidden > 0, 1.0, 0.0)

    @property
    def dense_width(self) -> jax.Array:
        """Inner width of the dense MLP layers of a MoE model: `dense_ffn_hidden` or
        `ffn_hidden`."""
        return jnp.where(self.dense_ffn_hidden > 0, self.dense_ffn_hidden, self.ffn_hidden)

    def expert_params(self) -> jax.Array:
        """Weights of the (expert) MLPs, all experts, mean per layer: the part that expert
        parallelism shards (a dense model's MLP), count."""
        return ((1.0 - self.dense_fraction) * self.num_experts * self.mlp_matrices
                * self.hidden * self.ffn_hidden)

    def layer_params(self) -> jax.Array:
        """Parameters of one transformer block (weights; biases and norms included), mean
        over the layers where MoE and dense-MLP layers mix, count."""
        h = self.hidden
        # + 2 h of biases, or MLA's two latent norms
        attn = self.attention_weights() + jnp.where(
            self.kv_lora_rank > 0, self.q_lora_rank + self.kv_lora_rank, 2.0 * h)
        router = jnp.where(self.num_experts > 1, h * self.num_experts, 0.0)
        shared = self.mlp_matrices * h * self.shared_ffn_hidden
        dense = self.mlp_matrices * h * self.dense_width
        r = self.dense_fraction
        norms = 4 * h
        return (attn + self.expert_params() + (1.0 - r) * (router + shared) + r * dense
                + norms)

    def active_layer_params(self) -> jax.Array:
        """Parameters one token touches in a block (MoE: only its top-k experts), mean over
        the layers, count."""
        unused = (self.num_experts - self.experts_per_token) * (
            self.mlp_matrices * self.hidden * self.ffn_hidden)
        return self.layer_params() - (1.0 - self.dense_fraction) * unused

    def num_params(self) -> jax.Array:
        """Total parameters: the blocks, the input embedding and (unless tied) the output
        head, count."""
        return (self.layers * self.layer_params()
                + (2.0 - self.tied_embeddings) * self.vocab * self.hidden)
