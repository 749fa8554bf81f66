"""Hugging Face config.json -> Transformer: published parameter counts of real configurations,
the architecture details that change them (head_dim, tied embeddings, GeGLU, MoE expert width,
Falcon's KV heads), refusals of what is not modelled and warnings for what is approximated."""

from __future__ import annotations

import json
import warnings

import pytest

import diffperf as dp
from diffperf.specs import transformer_from_hf_config

LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192, "hidden_act": "silu",
             "tie_word_embeddings": False, "rope_theta": 500000.0}
GEMMA_7B = {"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576,
            "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
            "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192,
            "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960,
                 "tie_word_embeddings": False, "hidden_act": "silu"}
MISTRAL_NEMO_12B = {"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 14336,
                    "num_hidden_layers": 40, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072,
                    "max_position_embeddings": 1024000, "hidden_act": "silu",
                    "tie_word_embeddings": False}
# Falcon-7B as `save_pretrained` writes it: num_kv_heads = 71 next to multi_query = true.
FALCON_7B_RESAVED = {"model_type": "falcon", "hidden_size": 4544, "num_hidden_layers": 32,
                     "num_attention_heads": 71, "num_kv_heads": 71, "multi_query": True,
                     "new_decoder_architecture": False, "parallel_attn": True,
                     "vocab_size": 65024, "alibi": False, "bias": False}
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
        "vocab_size": 50257, "n_inner": None, "activation_function": "gelu_new",
        "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}


#: The fields a config may give its context length in; without any, loading warns.
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "seq_length", "max_seq_len")


def load(tmp_path, cfg, **kw):
    """Load `cfg` as a config.json."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return transformer_from_hf_config(path, **kw)


@pytest.mark.parametrize("cfg, published_billion, tolerance", [
    (LLAMA3_8B, 8.030, 0.002),         # Meta: 8.03 B
    (GEMMA_7B, 8.538, 0.002),          # head_dim 256 > 3072 / 16, GeGLU, tied: 8.54 B
    (QWEN3_30B_A3B, 30.53, 0.003),     # 128 experts of width 768 (not 6144): 30.5 B
    (MISTRAL_NEMO_12B, 12.25, 0.003),  # q / o projections 32 x 128 = 4096 wide, not 5120
    (FALCON_7B_RESAVED, 6.922, 0.002),  # multi-query (1 KV head) despite num_kv_heads = 71
    (GPT2, 0.1244, 0.01),              # tied; its 0.8 M position embeddings are not counted
])
def test_published_parameter_counts(tmp_path, cfg, published_billion, tolerance):
    if any(k in cfg for k in CONTEXT_FIELDS):
        m = load(tmp_path, cfg)
    else:  # Falcon-7B's config names no context length: 2048 is assumed, with a warning
        with pytest.warns(UserWarning, match="no context length"):
            m = load(tmp_path, cfg)
    n = float(m.num_params()) / 1e9
    assert abs(n / published_billion - 1) < tolerance, n


def test_architecture_details_are_read(tmp_path):
    gemma = load(tmp_path, GEMMA_7B)
    assert float(gemma.gated_mlp) == 1 and float(gemma.tied_embeddings) == 1
    assert float(gemma.head_dim) == 256 and float(gemma.attention_width) == 4096
    qwen = load(tmp_path, QWEN3_30B_A3B)
    assert float(qwen.ffn_hidden) == 768 and float(qwen.num_experts) == 128
    active = float(qwen.layers * qwen.active_layer_params() + 2 * qwen.vocab * qwen.hidden) / 1e9
    assert abs(active / 3.35 - 1) < 0.01  # "A3B": 3.3 B active
    with pytest.warns(UserWarning, match="no context length"):
        falcon = load(tmp_path, FALCON_7B_RESAVED)
    assert float(falcon.kv_heads) == 1 and float(falcon.parallel_attention) == 1
    llama = load(tmp_path, LLAMA3_8B)
    assert float(llama.head_width) == 0 and float(llama.tied_embeddings) == 0  # d = h / a
    # Minitron: 48 heads of 128 do not divide hidden 4096; valid because head_dim is given.
    minitron = load(tmp_path, dict(LLAMA3_8B, num_attention_heads=48, head_dim=128))
    assert float(minitron.attention_width) == 6144


def test_training_sequence_length_of_a_context_extended_model(tmp_path):
    """Llama 3.1 was pre-trained at 8,192 tokens and extended to 131,072: the training
    default is the original length; an explicit seq_len wins."""
    cfg = dict(LLAMA3_8B, max_position_embeddings=131072,
               rope_scaling={"rope_type": "llama3", "factor": 8.0,
                             "original_max_position_embeddings": 8192})
    assert float(load(tmp_path, cfg).seq_len) == 8192
    assert float(load(tmp_path, cfg, seq_len=4096).seq_len) == 4096
    assert float(load(tmp_path, cfg, max_context=True).seq_len) == 131072  # what it serves
    assert float(load(tmp_path, dict(LLAMA3_8B, max_position_embeddings=32768)).seq_len) == 32768


@pytest.mark.parametrize("extra, needle", [
    ({"index_topk": 2048, "index_n_heads": 64}, "sparse / compressed attention (index_topk"),
    ({"o_lora_rank": 1024, "compress_ratios": [0, 4]}, "compress_ratios, o_lora_rank"),
    ({"num_experts": 1, "shared_expert_intermediate_size": 1000}, "shared experts without"),
    ({"model_type": "llama4_text", "interleave_moe_layer_step": 1}, "chunked attention"),
    ({"model_type": "jamba"}, "not a decoder-only transformer"),
    ({"model_type": "t5", "is_encoder_decoder": True}, "not a decoder-only transformer"),
])
def test_unmodelled_architectures_are_refused(tmp_path, extra, needle):
    with pytest.raises(ValueError, match="not modelled") as e:
        load(tmp_path, dict(QWEN3_30B_A3B, **extra))
    assert needle in str(e.value) and "config.json" in str(e.value)


QWEN15_MOE_A27B = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
                   "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                   "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                   "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1,
                   "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 8192,
                   "tie_word_embeddings": False, "hidden_act": "silu"}


def test_shared_experts(tmp_path):
    """Qwen1.5-MoE-A2.7B: 60 routed experts of 1,408 (top 4) and a 5,632-wide shared expert.
    Published: 14.3 B parameters, 2.7 B active."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # modelled, not approximated: no warning
        m = load(tmp_path, QWEN15_MOE_A27B)
    assert (float(m.num_experts), float(m.experts_per_token)) == (60, 4)
    assert float(m.shared_ffn_hidden) == 5632
    assert abs(float(m.num_params()) / 14.32e9 - 1) < 0.003
    active = float(m.layers * m.active_layer_params() + 2 * m.vocab * m.hidden) / 1e9
    assert abs(active / 2.69 - 1) < 0.01


def test_approximations_warn(tmp_path):
    with pytest.warns(UserWarning, match="only its language model"):
        m = load(tmp_path, {"model_type": "llava", "text_config": LLAMA3_8B,
                            "vision_config": {"hidden_size": 1024}})
    assert float(m.hidden) == 4096


def test_a_multimodal_config_without_sizes_is_refused(tmp_path):
    with pytest.raises(ValueError, match="text_config.*does not list its sizes"):
        load(tmp_path, {"model_type": "llava", "text_config": {"model_type": "llama"}})


def test_older_field_names(tmp_path):
    with pytest.warns(UserWarning, match="no context length"):  # BLOOM's config names none
        bloom = load(tmp_path, {"model_type": "bloom", "n_embed": 14336, "n_layer": 70,
                                "num_attention_heads": 112, "vocab_size": 250880})
    assert abs(float(bloom.num_params()) / 176.25e9 - 1) < 0.002  # BLOOM 176 B, tied
    mpt = load(tmp_path, {"model_type": "mpt", "d_model": 4096, "n_heads": 32, "n_layers": 32,
                          "expansion_ratio": 4, "max_seq_len": 2048, "vocab_size": 50432})
    assert float(mpt.ffn_hidden) == 16384 and abs(float(mpt.num_params()) / 6.65e9 - 1) < 0.005


GEMMA2_9B = {"model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336,
             "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192,
             "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"}


def window_of(m):
    return float(m.sliding_window), float(m.global_layers)


def test_sliding_window_layouts(tmp_path):
    """Which layers slide, from each way configs say it: every layer (Mistral 7B v0.1), every
    other one (Gemma 2: 21 of 42 stay global; published 9.24 B parameters), every 6th global
    (Gemma 3's `sliding_window_pattern`: 62 layers -> 10 global), `layer_types` (gpt-oss,
    newer configs), Qwen2's `max_window_layers`, and windows a config lists but does not use."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a modelled window is not a warning any more
        mistral = load(tmp_path, dict(LLAMA3_8B, model_type="mistral", sliding_window=4096,
                                      max_position_embeddings=32768))
    assert window_of(mistral) == (4096, 0)
    gemma2 = load(tmp_path, GEMMA2_9B)
    assert window_of(gemma2) == (4096, 21)
    assert abs(float(gemma2.num_params()) / 9.24e9 - 1) < 0.003
    gemma3 = dict(GEMMA2_9B, model_type="gemma3_text", num_hidden_layers=62, sliding_window=1024,
                  sliding_window_pattern=6)
    assert window_of(load(tmp_path, gemma3)) == (1024, 10)
    types = ["sliding_attention", "full_attention"] * 12
    oss = dict(LLAMA3_8B, num_hidden_layers=24, sliding_window=128, layer_types=types)
    assert window_of(load(tmp_path, oss)) == (128, 12)
    assert window_of(load(tmp_path, dict(oss, layer_types=["full_attention"] * 24))) == (0, 0)
    qwen = dict(LLAMA3_8B, model_type="qwen2", num_hidden_layers=28, sliding_window=4096,
                max_window_layers=21)
    assert window_of(load(tmp_path, dict(qwen, use_sliding_window=True))) == (4096, 21)
    assert window_of(load(tmp_path, dict(qwen, use_sliding_window=False))) == (0, 0)
    assert window_of(load(tmp_path, dict(LLAMA3_8B, sliding_window=None))) == (0, 0)


def test_bad_sliding_window_fields_are_named(tmp_path):
    base = dict(LLAMA3_8B, num_hidden_layers=4, sliding_window=128)
    with pytest.raises(ValueError, match="layer_types \\['chunked_attention'\\]"):
        load(tmp_path, dict(base, layer_types=["chunked_attention"] * 4))
    with pytest.raises(ValueError, match="layer_types lists 3 layers, the model has 4"):
        load(tmp_path, dict(base, layer_types=["full_attention"] * 3))
    with pytest.raises(ValueError, match="'sliding_window' must be a number"):
        load(tmp_path, dict(base, sliding_window="4k"))
    with pytest.raises(ValueError, match="'sliding_window_pattern' must be >= 1"):
        load(tmp_path, dict(base, sliding_window_pattern=0))
    with pytest.raises(ValueError, match="'sliding_window' must be >= 0"):
        load(tmp_path, dict(base, sliding_window=-5))


def test_a_missing_mlp_width_or_a_zero_context_is_named(tmp_path):
    """A gated (SwiGLU) config without intermediate_size falls back to GPT-2's 4 x hidden with
    a warning (Llama-3 8B would get 8.8 B parameters instead of 8.0 B); GPT-2's own null n_inner
    is that convention and stays silent; a zero context names the config field."""
    no_width = {k: v for k, v in LLAMA3_8B.items() if k != "intermediate_size"}
    with pytest.warns(UserWarning, match="no MLP width \\(intermediate_size\\): assumed 4 x"):
        assert float(load(tmp_path, no_width).ffn_hidden) == 4 * 4096
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(tmp_path, GPT2)
    with pytest.raises(ValueError, match="field 'max_position_embeddings' \\(the context "
                                         "length\\) must be >= 1"):
        load(tmp_path, dict(LLAMA3_8B, max_position_embeddings=0))


# DeepSeek-MoE 16B (deepseek-ai/deepseek-moe-16b-base): layer 0 dense (10944 wide), 27 MoE
# layers of 64 routed + 2 shared experts 1408 wide, top 6. Published: 16.4 B parameters, 2.8 B
# activated per token (DeepSeekMoE paper, Dai et al. 2024).
DEEPSEEK_MOE_16B = {"model_type": "deepseek", "hidden_size": 2048, "intermediate_size": 10944,
                    "moe_intermediate_size": 1408, "num_hidden_layers": 28,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
                    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
                    "moe_layer_freq": 1, "vocab_size": 102400, "max_position_embeddings": 4096,
                    "tie_word_embeddings": False, "hidden_act": "silu"}


def test_dense_layers_of_moe_models(tmp_path):
    m = load(tmp_path, DEEPSEEK_MOE_16B)
    assert (float(m.dense_layers), float(m.dense_ffn_hidden)) == (1, 10944)
    assert (float(m.num_experts), float(m.experts_per_token)) == (64, 6)
    assert float(m.shared_ffn_hidden) == 2 * 1408
    assert abs(float(m.num_params()) / 16.4e9 - 1) < 0.01
    active = float(m.layers * m.active_layer_params() + 2 * m.vocab * m.hidden)
    assert abs(active / 2.8e9 - 1) < 0.02
    # Qwen-MoE's rules: layers listed in mlp_only_layers, and all but every step-th layer
    qwen = dict(QWEN3_30B_A3B, decoder_sparse_step=2)  # 48 layers: 24 MoE, 24 dense
    m = load(tmp_path, qwen)
    assert (float(m.dense_layers), float(m.dense_ffn_hidden)) == (24, 6144)
    m = load(tmp_path, dict(QWEN3_30B_A3B, mlp_only_layers=[0, 1, 47]))
    assert float(m.dense_layers) == 3
    # Mixtral-style configs: the dense width defaults to the expert width
    m = load(tmp_path, dict(QWEN3_30B_A3B, moe_intermediate_size=None, mlp_only_layers=[0]))
    assert (float(m.dense_layers), float(m.dense_ffn_hidden)) == (1, 0)
    with pytest.raises(ValueError, match="none of the 48 layers is a MoE layer"):
        load(tmp_path, dict(QWEN3_30B_A3B, first_k_dense_replace=48))
    with pytest.raises(ValueError, match="'mlp_only_layers' must be a list"):
        load(tmp_path, dict(QWEN3_30B_A3B, mlp_only_layers="0,1"))
    with pytest.raises(ValueError, match="'decoder_sparse_step' must be >= 1"):
        load(tmp_path, dict(QWEN3_30B_A3B, decoder_sparse_step=0))


def test_a_missing_model_type_is_taken_from_architectures(tmp_path):
    """Without model_type the family's MLP kind and dropout would silently change (a Llama
    config read as a GELU MLP with dropout); the architectures class names it."""
    cfg = {k: v for k, v in LLAMA3_8B.items() if k not in ("model_type", "hidden_act")}
    with pytest.warns(UserWarning, match="taken as 'llama' from architectures"):
        m = load(tmp_path, {**cfg, "architectures": ["LlamaForCausalLM"]})
    ref = load(tmp_path, LLAMA3_8B)
    assert float(m.gated_mlp) == float(ref.gated_mlp) == 1.0
    assert float(m.dropout) == float(ref.dropout) == 0.0
    with pytest.warns(UserWarning, match="no model_type .architectures 'Foo' not known"):
        load(tmp_path, {**cfg, "architectures": ["FooForCausalLM"]})


def test_a_missing_context_length_warns_unless_the_length_is_given(tmp_path):
    cfg = {k: v for k, v in LLAMA3_8B.items() if k != "max_position_embeddings"}
    with pytest.warns(UserWarning, match="no context length .* assumed 2048"):
        assert float(load(tmp_path, cfg).seq_len) == 2048
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(load(tmp_path, cfg, seq_len=4096).seq_len) == 4096


@pytest.mark.parametrize("value, shown", [("-Infinity", "-inf"), ("Infinity", "inf"),
                                          ("NaN", "nan")])
def test_a_non_finite_count_names_the_file_and_the_field(tmp_path, value, shown):
    """JSON's NaN / Infinity parse as floats: -Infinity layers ended in a Python OverflowError
    and NaN in a message naming neither the file nor the field (issue 41, item 7)."""
    text = json.dumps(LLAMA3_8B).replace('"num_hidden_layers": 32',
                                         f'"num_hidden_layers": {value}')
    assert value in text
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"config.json: field 'num_hidden_layers' must be a "
                                         rf"finite number, got {shown}$"):
        transformer_from_hf_config(path)


def test_a_non_finite_layer_count_of_a_moe_config_is_not_a_traceback(tmp_path):
    """In a MoE config the layer count also lays out the dense / MoE layers, where -Infinity
    raised OverflowError from `int()`."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_30B_A3B).replace('"num_hidden_layers": 48',
                                                      '"num_hidden_layers": -Infinity'))
    with pytest.raises(ValueError, match="field 'num_hidden_layers' must be a finite number"):
        transformer_from_hf_config(path)


#: openai/gpt-oss-120b config.json (the fields diffperf reads).
GPT_OSS_120B = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
                "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
                "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4,
                "vocab_size": 201088, "max_position_embeddings": 131072,
                "hidden_act": "silu", "swiglu_limit": 7.0, "sliding_window": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18,
                "tie_word_embeddings": False}


def test_gpt_oss_biased_clamped_experts(tmp_path):
    """gpt-oss's experts carry biases (its model type) and clamp their SwiGLU (`swiglu_limit`);
    the loaded config matches the shipped preset on every architecture field; no limit means
    no clamp, and another model type has no expert biases."""
    m = load(tmp_path, GPT_OSS_120B)
    assert float(m.expert_bias) == 1.0 and float(m.glu_clamp) == 1.0
    preset = dp.model("gpt-oss-120b")
    for name in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "num_experts",
                 "experts_per_token", "head_width", "sliding_window", "global_layers",
                 "expert_bias", "glu_clamp", "gated_mlp"):
        assert float(getattr(m, name)) == float(getattr(preset, name)), name
    no_limit = {k: v for k, v in GPT_OSS_120B.items() if k != "swiglu_limit"}
    assert float(load(tmp_path, no_limit).glu_clamp) == 0.0
    assert float(load(tmp_path, LLAMA3_8B).expert_bias) == 0.0
