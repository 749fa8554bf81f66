"""The transformer LLM being trained or served (architecture only, no parallelism)."""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._checks import (MAX_EXACT_COUNT, as_float, check_divides, check_fraction, check_integer,
                      is_concrete, read_json)

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

    def __check_init__(self):
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len",
                     "num_experts", "experts_per_token"):
            check_integer("Transformer", name, getattr(self, name))
        check_fraction("Transformer", "gated_mlp", self.gated_mlp)
        check_integer("Transformer", "gated_mlp", self.gated_mlp, minimum=0)
        check_fraction("Transformer", "parallel_attention", self.parallel_attention)
        check_integer("Transformer", "parallel_attention", self.parallel_attention, minimum=0)
        check_fraction("Transformer", "dropout", self.dropout)
        check_integer("Transformer", "dropout", self.dropout, minimum=0)
        check_divides("Transformer", "heads", self.heads, "hidden", self.hidden)
        check_divides("Transformer", "kv_heads", self.kv_heads, "heads", self.heads)
        if is_concrete(self.experts_per_token, self.num_experts):
            k, e = np.asarray(self.experts_per_token), np.asarray(self.num_experts)
            if np.any(k > e):
                raise ValueError(f"Transformer.experts_per_token={float(np.max(k)):g} exceeds "
                                 f"num_experts={float(np.max(e)):g}")

    @property
    def head_dim(self) -> jax.Array:
        """Per-head width d = h / a."""
        return self.hidden / self.heads

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
        attn = h * (self.heads + 2 * self.kv_heads) * self.head_dim + h * h + 2 * h
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
        """Total parameters (untied input embedding and output head), count."""
        return self.layers * self.layer_params() + 2 * self.vocab * self.hidden


#: Hugging Face config fields holding dropout probabilities (Llama / Mistral / Qwen2 / Falcon /
#: GPT-NeoX / GPT-2 / GPT-J names).
_DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop",
                   "embd_pdrop", "dropout", "hidden_dropout_prob", "attention_probs_dropout_prob")


#: Hugging Face `model_type`s whose configuration classes default every dropout to 0.
_DROPOUT_FREE_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                       "gpt_neox", "falcon", "gptj", "gemma", "gemma2", "phi3", "deepseek_v2",
                       "deepseek_v3", "olmo", "olmo2")


def transformer_from_hf_config(path: str | Path, seq_len: int | None = None) -> Transformer:
    """Build a `Transformer` from a local Hugging Face `config.json` (no network access).

    Understands the Llama / Mistral / Mixtral / Qwen2 / GPT-NeoX / GPT-2 / GPT-J / Falcon
    field names. `seq_len` defaults to `max_position_embeddings` (or `n_positions`).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    cfg = read_json(path, "Hugging Face config")

    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")

    def pick(*names, default=None):
        for n in names:
            if n in cfg and cfg[n] is not None:
                v = cfg[n]
                numeric = not isinstance(default, str)
                if numeric and (isinstance(v, bool) or not isinstance(v, (int, float))):
                    raise ValueError(f"{path}: field {n!r} must be a number, got {v!r}")
                if numeric and v > MAX_EXACT_COUNT:
                    shown = (f"{v:.6g}" if isinstance(v, float) or len(str(v)) <= 20
                             else f"an integer of {len(str(v))} digits")
                    raise ValueError(f"{path}: field {n!r} must be <= {MAX_EXACT_COUNT} (2^24: "
                                     f"larger counts are not exact in float32), got {shown}")
                return v
        if default is not None:
            return default
        raise ValueError(f"{path}: none of the fields {names} is present")

    hidden = pick("hidden_size", "n_embd", "d_model")
    heads = pick("num_attention_heads", "n_head", "num_heads")
    kv = pick("num_key_value_heads", "num_kv_heads", "n_head_kv", default=heads)
    if cfg.get("multi_query") and "num_kv_heads" not in cfg and "n_head_kv" not in cfg:
        kv = 1
    ffn = pick("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim", default=4 * hidden)
    act = str(pick("hidden_act", "activation_function", "activation", default="gelu")).lower()
    model_type = str(cfg.get("model_type", "")).lower()
    gated = 1 if (act in ("silu", "swiglu", "swish") or model_type in ("llama", "mistral",
                                                                     "mixtral", "qwen2")) else 0
    # Parallel attention + MLP: Falcon's `parallel_attn`, GPT-NeoX's `use_parallel_residual`
    # (default true), GPT-J always.
    parallel = bool(cfg.get("parallel_attn", False)
                    or cfg.get("use_parallel_residual", model_type == "gpt_neox")
                    or model_type == "gptj")
    # Dropout: on if any of the config's dropout probabilities is positive. A config that names
    # none takes its model class's default: off for the dropout-free families (e.g. Llama-2's
    # config.json has no dropout field), on otherwise.
    rates = [cfg[k] for k in _DROPOUT_FIELDS if isinstance(cfg.get(k), (int, float))
             and not isinstance(cfg.get(k), bool)]
    if rates:
        dropout = 1 if any(r > 0 for r in rates) else 0
    else:
        dropout = 0 if model_type in _DROPOUT_FREE_TYPES else 1
    return Transformer(
        layers=pick("num_hidden_layers", "n_layer", "num_layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        ffn_hidden=ffn,
        vocab=pick("vocab_size", "padded_vocab_size"),
        seq_len=seq_len if seq_len is not None else pick("max_position_embeddings", "n_positions",
                                                         "seq_length", default=2048),
        gated_mlp=gated,
        num_experts=pick("num_local_experts", "num_experts", "n_routed_experts", default=1),
        experts_per_token=pick("num_experts_per_tok", "moe_top_k", default=1),
        parallel_attention=1 if parallel else 0,
        dropout=dropout,
    )
