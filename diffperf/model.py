"""The transformer LLM being trained or served (architecture only, no parallelism)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._checks import as_float, check_divides, check_fraction, check_integer, is_concrete

def _F():
    return eqx.field(converter=as_float)


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
    """

    layers: jax.Array = _F()
    hidden: jax.Array = _F()
    heads: jax.Array = _F()
    kv_heads: jax.Array = _F()
    ffn_hidden: jax.Array = _F()
    vocab: jax.Array = _F()
    seq_len: jax.Array = eqx.field(converter=as_float, default=2048)
    gated_mlp: jax.Array = eqx.field(converter=as_float, default=0)
    num_experts: jax.Array = eqx.field(converter=as_float, default=1)
    experts_per_token: jax.Array = eqx.field(converter=as_float, default=1)
    parallel_attention: jax.Array = eqx.field(converter=as_float, default=0)
    dropout: jax.Array = eqx.field(converter=as_float, default=1)
    head_width: jax.Array = eqx.field(converter=as_float, default=0)
    tied_embeddings: jax.Array = eqx.field(converter=as_float, default=0)

    def __check_init__(self):
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len",
                     "num_experts", "experts_per_token"):
            check_integer("Transformer", name, getattr(self, name))
        check_integer("Transformer", "head_width", self.head_width, minimum=0)
        check_fraction("Transformer", "tied_embeddings", self.tied_embeddings)
        check_integer("Transformer", "tied_embeddings", self.tied_embeddings, minimum=0)
        check_fraction("Transformer", "gated_mlp", self.gated_mlp)
        check_integer("Transformer", "gated_mlp", self.gated_mlp, minimum=0)
        check_fraction("Transformer", "parallel_attention", self.parallel_attention)
        check_integer("Transformer", "parallel_attention", self.parallel_attention, minimum=0)
        check_fraction("Transformer", "dropout", self.dropout)
        check_integer("Transformer", "dropout", self.dropout, minimum=0)
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
        `head_width` says otherwise)."""
        return self.heads * self.head_dim

    @property
    def mlp_matrices(self) -> jax.Array:
        """Weight matrices per MLP (per expert): 3 for gated (SwiGLU), 2 otherwise."""
        return 2.0 + self.gated_mlp

    @property
    def tp_reductions_per_pass(self) -> jax.Array:
        """Tensor-parallel reductions per layer and pass: one after attention and one after
        the MLP, or one for the summed branches of a parallel attention + MLP block."""
        return 2.0 - self.parallel_attention

    def layer_params(self) -> jax.Array:
        """Parameters of one transformer block (weights; biases and norms included), count."""
        h, f = self.hidden, self.ffn_hidden
        attn = (h * (self.heads + 2 * self.kv_heads) * self.head_dim
                + self.attention_width * h + 2 * h)
        mlp = self.num_experts * self.mlp_matrices * h * f
        router = jnp.where(self.num_experts > 1, h * self.num_experts, 0.0)
        norms = 4 * h
        return attn + mlp + router + norms

    def active_layer_params(self) -> jax.Array:
        """Parameters one token touches in a block (MoE: only its top-k experts), count."""
        dense = self.layer_params() - (self.num_experts - self.experts_per_token) * (
            self.mlp_matrices * self.hidden * self.ffn_hidden)
        return dense

    def num_params(self) -> jax.Array:
        """Total parameters: the blocks, the input embedding and (unless tied) the output
        head, count."""
        return (self.layers * self.layer_params()
                + (2.0 - self.tied_embeddings) * self.vocab * self.hidden)
