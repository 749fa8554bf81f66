"""A Hugging Face `config.json` read as a diffperf `Transformer` (local file, no network).

Parameter counts match the published ones for the configurations of `tests/test_hf_config.py`
(Llama 3, Gemma, Qwen3-MoE, Qwen1.5-MoE, Mistral-NeMo, Falcon, GPT-2, BLOOM, MPT) and, in an
audit of 36 configurations, also Llama 2 / 3.1, Mistral, Mixtral, Qwen2 / 2.5, Gemma 2,
Phi-2 / 3, GPT-J, GPT-NeoX, OPT, StarCoder and Command-R. Architectures the model cannot
represent are refused with the reason instead of approximated silently: Llama 4 (chunked
attention), sparse / compressed attention (DeepSeek-V3.2, V4, GLM-5), state-space / recurrent
hybrids (Mamba, Jamba, Nemotron-H) and encoder-decoders (T5, BART, Whisper). Modelled, each as
its own `Transformer` field:
- multi-head latent attention (DeepSeek-V2 / V3, Kimi K2: `kv_lora_rank` and friends);
- dense-MLP layers of MoE models (DeepSeek and GLM-4.5's first layers, `mlp_only_layers`,
  `decoder_sparse_step`), spread evenly over the pipeline stages;
- shared experts (Qwen-MoE, DeepSeek, GLM-4.5);
- sliding-window attention (Mistral 7B v0.1, Gemma 2 / 3, gpt-oss, Qwen2 with
  `use_sliding_window`): the window and the layers that keep full attention come from
  `sliding_window` with `layer_types`, `sliding_window_pattern`, Gemma 2's alternation or
  Qwen2's `max_window_layers`.
Approximated with a warning: a multimodal config as its language model. Ignored: `torch_dtype` /
`quantization_config` (precision comes from the plan), learned position embeddings,
multi-token-prediction layers.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

from .._checks import MAX_EXACT_COUNT, read_json
from ._transformer import Transformer

#: Hugging Face config fields holding dropout probabilities (Llama / Mistral / Qwen2 / Falcon /
#: GPT-NeoX / GPT-2 / GPT-J names).
_DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop",
                   "embd_pdrop", "dropout", "hidden_dropout_prob", "attention_probs_dropout_prob")

#: `model_type`s whose configuration classes default every dropout to 0.
_DROPOUT_FREE_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                       "gpt_neox", "falcon", "gptj", "gemma", "gemma2", "gemma3_text", "phi3",
                       "deepseek_v2", "deepseek_v3", "olmo", "olmo2", "cohere", "granite")

#: `model_type`s with a gated (three-matrix) MLP whatever their activation is called (Gemma's
#: GeGLU is "gelu" / "gelu_pytorch_tanh" with gate, up and down projections).
_GATED_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                "gemma", "gemma2", "gemma3_text", "phi3", "cohere", "olmo", "olmo2", "granite",
                "internlm2", "deepseek_v2", "deepseek_v3")

#: `model_type`s whose block always adds attention and MLP of the same input (parallel block).
_PARALLEL_TYPES = ("gptj", "phi", "cohere")

#: `model_type`s whose config classes tie the output head to the embedding by default (when
#: `tie_word_embeddings` is absent; the other classes default to separate matrices).
_TIED_TYPES = ("gpt2", "gpt_bigcode", "opt", "bloom", "falcon", "refinedweb", "refinedwebmodel",
               "gemma", "gemma2", "gemma3_text", "cohere", "mpt")

#: `model_type`s whose routed experts' linear layers carry biases (config.json has no field for
#: it; transformers' `GptOssExperts` holds `gate_up_proj_bias` and `down_proj_bias`).
_EXPERT_BIAS_TYPES = ("gpt_oss",)

#: Falcon's config class (and its older RefinedWeb names).
_FALCON_TYPES = ("falcon", "refinedweb", "refinedwebmodel")

_HIDDEN = ("hidden_size", "n_embd", "n_embed", "d_model")

#: Config fields of attention variants beyond MLA: DeepSeek Sparse Attention's indexer
#: (DeepSeek-V3.2, GLM-5), DeepSeek-V4's compressed KV and low-rank output.
_SPARSE_ATTENTION_FIELDS = ("index_topk", "index_n_heads", "compress_ratios", "o_lora_rank")

#: `model_type`s that are not (only) decoder transformer blocks: state-space / recurrent
#: hybrids and encoder-decoders.
_NOT_DECODER_TYPES = ("mamba", "mamba2", "falcon_mamba", "jamba", "zamba", "zamba2", "bamba",
                      "nemotron_h", "granitemoehybrid", "rwkv", "recurrent_gemma", "xlstm",
                      "t5", "mt5", "umt5", "bart", "mbart", "pegasus", "whisper")


def _is_number(v) -> bool:
    """A JSON number (a bool is not one)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(path: Path, name: str, v):
    """A numeric config value, checked: a finite number (not a bool; JSON's NaN and Infinity
    parse as floats), at most 2^24."""
    if not _is_number(v):
        raise ValueError(f"{path}: field {name!r} must be a number, got {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{path}: field {name!r} must be a finite number, got {v!r}")
    if v > MAX_EXACT_COUNT:
        shown = (f"{v:.6g}" if isinstance(v, float) or len(str(v)) <= 20
                 else f"an integer of {len(str(v))} digits")
        raise ValueError(f"{path}: field {name!r} must be <= {MAX_EXACT_COUNT} (2^24: larger "
                         f"counts are not exact in float32), got {shown}")
    return v


def _language_model(path: Path, cfg: dict) -> dict:
    """The config of the language model: `cfg`, or a multimodal config's `text_config`."""
    if any(cfg.get(k) is not None for k in _HIDDEN) or not isinstance(cfg.get("text_config"),
                                                                        dict):
        return cfg
    text = cfg["text_config"]
    if not any(text.get(k) is not None for k in _HIDDEN):
        raise ValueError(f"{path}: a multimodal config whose language model ('text_config') "
                         f"does not list its sizes (it relies on its model type's defaults); "
                         f"pass the language model's own config.json")
    warnings.warn(f"{path}: a multimodal config: only its language model ('text_config') is "
                  f"modelled, not the vision / audio encoder", stacklevel=3)
    return text


def _refuse_unmodelled(path: Path, cfg: dict) -> None:
    """ValueError for architectures a `Transformer` cannot represent."""
    model_type = str(cfg.get("model_type", "")).lower()
    if model_type in _NOT_DECODER_TYPES or cfg.get("is_encoder_decoder"):
        raise ValueError(f"{path}: model_type {model_type!r} is not a decoder-only transformer "
                         f"(state-space / recurrent layers or an encoder-decoder): not modelled")
    if model_type in ("llama4", "llama4_text"):
        raise ValueError(f"{path}: Llama 4's chunked attention (attention_chunk_size) is not "
                         f"modelled")
    sparse = [k for k in _SPARSE_ATTENTION_FIELDS if cfg.get(k) is not None]
    if sparse:
        raise ValueError(f"{path}: sparse / compressed attention ({', '.join(sparse)}: DeepSeek "
                         f"Sparse Attention, DeepSeek-V4, GLM-5) is not modelled")


def _latent_attention(path: Path, cfg: dict, pick) -> dict:
    """The multi-head latent attention fields of a DeepSeek-V2 / V3 style config (`{}`
    without `kv_lora_rank`): `Transformer` kv_lora_rank, q_lora_rank (0 when null),
    rope_head_dim, v_head_dim, and head_width = qk_nope_head_dim."""
    if cfg.get("kv_lora_rank") is None:
        return {}
    return dict(kv_lora_rank=pick("kv_lora_rank"), q_lora_rank=pick("q_lora_rank", default=0),
                rope_head_dim=pick("qk_rope_head_dim"), v_head_dim=pick("v_head_dim"),
                head_width=pick("qk_nope_head_dim"))


def _dense_layers(path: Path, cfg: dict, pick, layers, experts, ffn) -> tuple[int, int]:
    """(dense_layers, dense_ffn_hidden) of a MoE config, (0, 0) where every layer is MoE.
    A layer i (from 0) is MoE as the Hugging Face model classes decide it: DeepSeek / GLM-4.5
    from `first_k_dense_replace` on, every `moe_layer_freq`-th (i % freq == 0); Qwen-MoE
    unless listed in `mlp_only_layers`, every `decoder_sparse_step`-th ((i + 1) % step == 0);
    every `interleave_moe_layer_step`-th likewise. The dense layers' width is
    `intermediate_size` (the experts' is `moe_intermediate_size`)."""
    if experts <= 1:
        return 0, 0
    first = cfg.get("first_k_dense_replace")
    first = 0 if first is None else _count(path, "first_k_dense_replace", first)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(_is_number(i) for i in only):
        raise ValueError(f"{path}: field 'mlp_only_layers' must be a list of layer indices, "
                         f"got {only!r}")
    steps = {}
    for name in ("moe_layer_freq", "decoder_sparse_step", "interleave_moe_layer_step"):
        v = cfg.get(name)
        steps[name] = 1 if v is None else _count(path, name, v)
        if steps[name] < 1:
            raise ValueError(f"{path}: field {name!r} must be >= 1, got {v!r}")
    moe = sum(1 for i in range(int(layers))
              if i >= first and i % steps["moe_layer_freq"] == 0 and i not in only
              and (i + 1) % steps["decoder_sparse_step"] == 0
              and (i + 1) % steps["interleave_moe_layer_step"] == 0)
    dense = int(layers) - moe
    if dense == 0:
        return 0, 0
    if moe == 0:
        raise ValueError(f"{path}: none of the {int(layers)} layers is a MoE layer "
                         f"(first_k_dense_replace / mlp_only_layers / steps): not a MoE model")
    width = pick("intermediate_size", "ffn_hidden_size", default=ffn)
    return dense, (0 if width == ffn else width)


def _sliding_window(path: Path, cfg: dict, model_type: str, layers) -> tuple[int, int]:
    """(sliding_window, global_layers) of a config, (0, 0) without a window. The layers that
    keep full attention are read from `layer_types` where the config lists them, else from
    `sliding_window_pattern` (Gemma 3, Cohere 2: every pattern-th layer is global), Gemma 2's
    alternation (every other layer), or Qwen2's `max_window_layers` (the layers below it are
    global); otherwise every layer slides (Mistral 7B v0.1, Phi-3)."""
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return 0, 0
    window = _count(path, "sliding_window", window)
    if window < 0:
        raise ValueError(f"{path}: field 'sliding_window' must be >= 0 (or null: no window), "
                         f"got {window}")
    if window == 0:
        return 0, 0
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        unknown = sorted({str(t) for t in types} - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{path}: layer_types {unknown} are not modelled (only "
                             f"'full_attention' and 'sliding_attention')")
        if len(types) != layers:
            raise ValueError(f"{path}: layer_types lists {len(types)} layers, the model has "
                             f"{layers}")
        sliding = types.count("sliding_attention")
        return (window, layers - sliding) if sliding else (0, 0)
    pattern = cfg.get("sliding_window_pattern")
    if pattern is not None:
        pattern = _count(path, "sliding_window_pattern", pattern)
        if pattern < 1:
            raise ValueError(f"{path}: field 'sliding_window_pattern' must be >= 1, got {pattern}")
        return window, int(layers // pattern)
    if model_type == "gemma2":
        return window, int(layers // 2)
    if cfg.get("use_sliding_window") and cfg.get("max_window_layers") is not None:
        below = _count(path, "max_window_layers", cfg["max_window_layers"])
        return window, int(min(max(below, 0), layers))
    return window, 0


def _model_type(path, cfg: dict) -> str:
    """The config's `model_type`, lower case; without one, the type its `architectures` class
    names (LlamaForCausalLM -> llama, GPTNeoXForCausalLM -> gpt_neox), with a warning, since
    the MLP kind, dropout and block layout of several families follow from it."""
    model_type = str(cfg.get("model_type", "")).lower()
    if model_type:
        return model_type
    arch = cfg.get("architectures")
    arch_name = str(arch[0]) if isinstance(arch, list) and arch else ""
    name = arch_name
    for suffix in ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "Model"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    known = {t.replace("_", ""): t for t in (*_GATED_TYPES, *_PARALLEL_TYPES, *_TIED_TYPES,
                                             *_FALCON_TYPES, *_DROPOUT_FREE_TYPES, "gpt_neox")}
    guess = known.get(name.lower().replace("_", ""))
    if guess:
        warnings.warn(f"{path}: no model_type: taken as {guess!r} from architectures "
                      f"{arch_name!r}", stacklevel=2)
        return guess
    unknown = f" (architectures {name!r} not known)" if name else ""
    warnings.warn(f"{path}: no model_type{unknown}: the MLP is taken as gated only if "
                  f"hidden_act says so (default gelu), and dropout as on", stacklevel=2)
    return ""


def _shared_width(path: Path, cfg: dict, pick, experts, ffn):
    """Inner width of a MoE layer's shared expert(s): Qwen-MoE's
    `shared_expert_intermediate_size`, or DeepSeek-MoE / GLM-4.5's `n_shared_experts` times
    the expert width; 0 without one."""
    if cfg.get("shared_expert_intermediate_size"):
        width = pick("shared_expert_intermediate_size")
    elif cfg.get("n_shared_experts"):
        width = pick("n_shared_experts") * ffn
    else:
        return 0
    if experts <= 1:
        raise ValueError(f"{path}: shared experts without routed experts (num_experts = "
                         f"{experts}) are not modelled")
    return width


def transformer_from_hf_config(path: str | Path, seq_len: int | None = None,
                               max_context: bool = False) -> Transformer:
    """Build a `Transformer` from a local Hugging Face `config.json` (or its directory).

    `seq_len` (training sequence length) defaults to `rope_scaling`'s
    `original_max_position_embeddings` (the pre-training context of a context-extended model),
    else `max_position_embeddings` (or `n_positions` / `seq_length` / `max_seq_len`), else 2048;
    with `max_context` always to the latter, the longest context the model serves (what
    inference checks a prompt against).
    Raises ValueError naming the file and field for missing or malformed fields and for
    architectures that are not modelled (see the module docstring).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    cfg = read_json(path, "Hugging Face config")
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")
    cfg = _language_model(path, cfg)
    _refuse_unmodelled(path, cfg)

    source: dict[str, str] = {}  # Transformer field -> the config field its value came from

    def pick(*names, default=None, field=None):
        for n in names:
            if n in cfg and cfg[n] is not None:
                if field is not None:
                    source[field] = n
                return cfg[n] if isinstance(default, str) else _count(path, n, cfg[n])
        if default is not None:
            return default
        raise ValueError(f"{path}: none of the fields {names} is present")

    model_type = _model_type(path, cfg)
    hidden = pick(*_HIDDEN, field="hidden")
    heads = pick("num_attention_heads", "n_head", "n_heads", "num_heads", field="heads")
    if model_type in _FALCON_TYPES and not cfg.get("new_decoder_architecture", False) and (
            model_type != "refinedweb"):
        # Falcon-7B style: one KV head if multi_query (the class default), else MHA; a re-saved
        # config also carries num_kv_heads = heads, which Falcon ignores in this layout.
        kv = 1 if cfg.get("multi_query", True) else heads
    else:
        kv = pick("num_key_value_heads", "num_kv_heads", "n_head_kv", default=heads,
                  field="kv_heads")
        if cfg.get("multi_query") and "num_kv_heads" not in cfg and "n_head_kv" not in cfg:
            kv = 1
    head_width = pick("head_dim", default=0, field="head_width")
    if head_width and head_width * heads == hidden:
        head_width = 0  # the usual h / a: keep the derived form
    experts = pick("num_local_experts", "num_experts", "n_routed_experts", default=1,
                   field="num_experts")
    if experts > 1 and cfg.get("moe_intermediate_size") is not None:
        # Qwen-MoE / DeepSeek: the expert width
        ffn = pick("moe_intermediate_size", field="ffn_hidden")
    elif cfg.get("expansion_ratio") is not None:
        ffn = pick("expansion_ratio") * hidden  # MPT
    else:
        ffn = pick("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim",
                   default=4 * hidden, field="ffn_hidden")
    top_k = pick("num_experts_per_tok", "moe_top_k", default=1, field="experts_per_token")
    shared = _shared_width(path, cfg, pick, experts, ffn)
    act = str(pick("hidden_act", "activation_function", "activation", default="gelu")).lower()
    gated = 1 if act in ("silu", "swiglu", "swish") or model_type in _GATED_TYPES else 0
    width_named = any(cfg.get(k) is not None for k in (
        "moe_intermediate_size", "expansion_ratio", "intermediate_size", "n_inner",
        "ffn_hidden_size", "ffn_dim"))
    if gated and not width_named:
        warnings.warn(f"{path}: no MLP width (intermediate_size): assumed 4 x hidden = {ffn}, "
                      f"GPT-2's convention; gated (SwiGLU) models usually differ", stacklevel=2)
    # Parallel attention + MLP: Falcon's `parallel_attn` (default true), GPT-NeoX's
    # `use_parallel_residual` (default true), GPT-J / Phi-2 / Command-R always.
    parallel = (model_type in _PARALLEL_TYPES
                or (model_type in _FALCON_TYPES and cfg.get("parallel_attn", True))
                or bool(cfg.get("parallel_attn", False))
                or bool(cfg.get("use_parallel_residual", model_type == "gpt_neox")))
    # Dropout: on if any of the config's dropout probabilities is positive. A config that names
    # none takes its model class's default: off for the dropout-free families (e.g. Llama-2's
    # config.json has no dropout field), on otherwise.
    rates = [cfg[k] for k in _DROPOUT_FIELDS if _is_number(cfg.get(k))]
    if rates:
        dropout = 1 if any(r > 0 for r in rates) else 0
    else:
        dropout = 0 if model_type in _DROPOUT_FREE_TYPES else 1
    context_fields = ("max_position_embeddings", "n_positions", "seq_length", "max_seq_len")
    if all(cfg.get(k) is None for k in context_fields) and seq_len is None:
        warnings.warn(f"{path}: no context length ({', '.join(context_fields)}): assumed 2048 "
                      f"tokens (diffperf train --seq-len sets the training length)", stacklevel=2)
    longest = pick(*context_fields, default=2048, field="seq_len")  # the longest it serves
    if seq_len is not None:
        source.pop("seq_len", None)  # the caller's length, not the config's
    if longest < 1:
        named = next(k for k in ("max_position_embeddings", "n_positions", "seq_length",
                                 "max_seq_len") if cfg.get(k) is not None)
        raise ValueError(f"{path}: field {named!r} (the context length) must be >= 1, got "
                         f"{longest}")
    if seq_len is None:
        rope = cfg.get("rope_scaling")
        if (not max_context and isinstance(rope, dict)
                and rope.get("original_max_position_embeddings") is not None):
            seq_len = _count(path, "rope_scaling.original_max_position_embeddings",
                             rope["original_max_position_embeddings"])
            source["seq_len"] = "rope_scaling.original_max_position_embeddings"
        else:
            seq_len = longest
    layers = pick("num_hidden_layers", "n_layer", "n_layers", "num_layers", field="layers")
    window, global_layers = _sliding_window(path, cfg, model_type, layers)
    dense_layers, dense_width = _dense_layers(path, cfg, pick, layers, experts, ffn)
    fields = dict(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        ffn_hidden=ffn,
        vocab=pick("vocab_size", "padded_vocab_size", field="vocab"),
        seq_len=seq_len,
        gated_mlp=gated,
        num_experts=experts,
        experts_per_token=top_k,
        parallel_attention=1 if parallel else 0,
        dropout=dropout,
        head_width=head_width,
        tied_embeddings=1 if cfg.get("tie_word_embeddings", model_type in _TIED_TYPES) else 0,
        sliding_window=window,
        global_layers=global_layers,
        dense_layers=dense_layers,
        dense_ffn_hidden=dense_width,
        shared_ffn_hidden=shared,
        # gpt-oss: biased experts (gate_up_proj_bias, down_proj_bias) and a clamped SwiGLU
        expert_bias=1 if model_type in _EXPERT_BIAS_TYPES and experts > 1 else 0,
        glu_clamp=1 if _is_number(cfg.get("swiglu_limit")) and cfg["swiglu_limit"] > 0 else 0,
    )
    fields.update(_latent_attention(path, cfg, pick))  # MLA: its own head widths
    try:
        return Transformer(**fields)
    except ValueError as e:  # a range check of the spec: say which file and field it came from
        text = re.sub(r"Transformer\.(\w+)",
                      lambda m: f"field {source[m[1]]!r}" if m[1] in source else m[0], str(e))
        raise ValueError(f"{path}: {text}") from None
