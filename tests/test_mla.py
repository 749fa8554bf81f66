"""Multi-head latent attention (DeepSeek-V2 / V3, Kimi K2): parameters against the published
671 B / 37 B of DeepSeek-V3, FLOPs, KV cache, decode traffic and weights per GPU by hand from
the shapes of the DeepSeek-V2 paper (Sec. 2.1), stored activations relative to standard
attention, batched mixes of both kinds == a loop, errors.

Shapes: queries h -> q_lora -> a (d_n + d_r); keys / values h -> c + d_r (cached) -> a (d_n +
d_v); output a d_v -> h. A decode step reads the cached c + d_r per token and layer, scores
against it with c + d_r wide queries and sums c wide values (weight absorption)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffperf as dp
from diffperf.inference import inference_ops
from diffperf.training import activation_bytes_per_layer

EFF = dp.Efficiency()
H100 = dp.system("h100-sxm5-80gb")

DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
               "n_routed_experts": 256, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
               "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
               "vocab_size": 129280, "max_position_embeddings": 163840,
               "tie_word_embeddings": False, "hidden_act": "silu", "num_nextn_predict_layers": 1,
               "rope_scaling": {"type": "yarn", "factor": 40,
                                "original_max_position_embeddings": 4096}}

# A small MLA model: 2 layers, h 1024, 8 heads, d_n 64, d_r 32, d_v 48, latents 384 / 256,
# a dense GeLU MLP 4096 wide.
H, A, DN, DR, DV, CQ, C, FF, V = 1024, 8, 64, 32, 48, 384, 256, 4096, 1000
SMALL = dp.Transformer(layers=2, hidden=H, heads=A, kv_heads=A, ffn_hidden=FF, vocab=V,
                       seq_len=512, head_width=DN, kv_lora_rank=C, q_lora_rank=CQ,
                       rope_head_dim=DR, v_head_dim=DV, dropout=0)
ATTN_WEIGHTS = H * CQ + CQ * A * (DN + DR) + H * (C + DR) + C * A * (DN + DV) + A * DV * H


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3") / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    return dp.transformer_from_hf_config(path)


def test_deepseek_v3_parameters_match_the_published_counts(v3):
    """DeepSeek-V3 technical report: 671 B parameters, 37 B activated per token (both without
    the multi-token-prediction module, which the loader ignores)."""
    assert abs(float(v3.num_params()) / 671e9 - 1) < 0.005
    active = float(v3.layers * v3.active_layer_params() + 2 * v3.vocab * v3.hidden)
    assert abs(active / 37e9 - 1) < 0.02
    assert float(v3.seq_len) == 4096  # the pre-training context under the YaRN extension


def test_kv_cache_holds_the_latent_on_every_gpu(v3):
    # 61 layers x (512 + 64) elements x 2 bytes per token, whatever the tensor parallelism
    for tp in (1, 8):
        plan = dp.InferencePlan(tp=tp, batch=2, input_len=1000, output_len=24)
        want = 61 * 576 * 2 * 1024 * 2
        assert float(dp.kv_cache_bytes_per_gpu(v3, plan)) == pytest.approx(want, rel=1e-6)


def test_training_flops_by_hand():
    B, s = 4, 512
    core = 2 * s * A * ((DN + DR) + DV)  # QK^T over d_n + d_r, AV over d_v, per token
    per_token = 2 * (2 * (ATTN_WEIGHTS + 2 * H * FF) + core) + 2 * H * V
    want = 3 * B * s * per_token
    got = float(dp.model_flops_per_step(SMALL, dp.TrainingPlan(global_batch=B)))
    assert got == pytest.approx(want, rel=1e-6)


def test_decode_reads_the_latent_once_per_step():
    b, n_in, n_out = 4, 300, 101
    plan = dp.InferencePlan(tp=2, batch=b, input_len=n_in, output_len=n_out)
    op = inference_ops(SMALL, H100, plan, EFF)["decode"]["attention"]
    contexts = (n_in + np.arange(1, n_out)).sum()
    assert float(op.bytes) == pytest.approx(2 * b * contexts * (C + DR) * 2, rel=1e-3)
    heads_per_gpu = A / 2
    want = 2 * 2 * b * heads_per_gpu * contexts * ((C + DR) + C)
    assert float(op.flops) == pytest.approx(want, rel=1e-3)


def test_weights_per_gpu_by_hand():
    plan = dp.InferencePlan(tp=2)
    down = H * CQ + H * (C + DR)  # replicated on both GPUs
    up = (CQ * A * (DN + DR) + C * A * (DN + DV) + A * DV * H) / 2
    mlp = 2 * H * FF / 2
    norms = 4 * H + CQ + C
    want = 2 * (2 * (down + up + mlp) + 2 * norms) + 2 * 2 * V * H / 2
    assert float(dp.weight_bytes_per_gpu(SMALL, plan)) == pytest.approx(want, rel=1e-6)


def test_stored_activations_exceed_standard_attention_by_the_latents():
    """Against MHA with d = d_n (and d_v = d_n): Q and K are d_r wider (2 bytes each per head),
    V and the attention output d_v - d_n narrower, and the query / KV latents (c_q, c + d_r)
    are kept for the up-projections' weight gradients."""
    mla = dataclasses.replace(SMALL, v_head_dim=DN)
    mha = dataclasses.replace(SMALL, kv_lora_rank=0, q_lora_rank=0, rope_head_dim=0,
                              v_head_dim=0)
    plan = dp.TrainingPlan(recompute=1, micro_batch=2, global_batch=2, flash_attention=1)
    per_token = 2 * 2 * A * DR + 2 * (CQ + C + DR)
    got = float(activation_bytes_per_layer(mla, plan) - activation_bytes_per_layer(mha, plan))
    assert got == pytest.approx(2 * 512 * per_token, rel=1e-6)


def test_batched_mla_and_standard_models_equal_a_loop():
    ranks = jnp.array([0.0, 256.0])  # standard attention next to MLA, traced together
    mha = dataclasses.replace(SMALL, kv_lora_rank=0, q_lora_rank=0, rope_head_dim=0,
                              v_head_dim=0)
    plan = dp.TrainingPlan(tp=2, dp=2, global_batch=8)
    served = dp.InferencePlan(tp=2, batch=4, input_len=256, output_len=64)

    def both(m):
        return jnp.stack([dp.train_step(m, H100, plan, EFF).step_time,
                          dp.infer(m, H100, served, EFF).tpot,
                          dp.infer(m, H100, served, EFF).memory.total])

    def pick(r):
        return jax.tree.map(lambda x, y: jnp.where(r > 0, x, y), SMALL, mha)

    batched = np.asarray(jax.vmap(lambda r: both(pick(r)))(ranks))
    assert np.all(np.isfinite(batched))
    np.testing.assert_allclose(batched, [np.asarray(both(mha)), np.asarray(both(SMALL))],
                               rtol=1e-5)


def test_mla_decode_is_cheaper_than_the_same_heads_with_full_kv():
    """The point of MLA: at a long context a decode step reads 576 elements per token and
    layer instead of 2 x 128 heads x 128 (DeepSeek-V3's heads as MHA)."""
    v3_like = dataclasses.replace(SMALL, heads=128, kv_heads=128, hidden=7168, head_width=128,
                                  kv_lora_rank=512, q_lora_rank=1536, rope_head_dim=64,
                                  v_head_dim=128, ffn_hidden=18432)
    mha = dataclasses.replace(v3_like, kv_lora_rank=0, q_lora_rank=0, rope_head_dim=0,
                              v_head_dim=0)
    served = dp.InferencePlan(tp=8, batch=16, input_len=16000, output_len=256)
    a, b = dp.infer(mha, H100, served, EFF), dp.infer(v3_like, H100, served, EFF)
    assert float(b.memory.kv_cache) < float(a.memory.kv_cache) / 7  # 576 vs 2 x 16 x 128
    assert float(b.decode.attention) < float(a.decode.attention) / 3


def test_bad_latent_fields_are_named():
    with pytest.raises(ValueError, match="q_lora_rank > 0 needs multi-head latent attention"):
        dataclasses.replace(dp.model("llama2-7b"), q_lora_rank=1536)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        dataclasses.replace(SMALL, kv_lora_rank=-1)


def test_queries_without_a_latent_by_hand():
    """DeepSeek-V2-Lite style: no `q_lora_rank`, queries projected from h directly."""
    lite = dataclasses.replace(SMALL, q_lora_rank=0)
    attn = H * A * (DN + DR) + H * (C + DR) + C * A * (DN + DV) + A * DV * H
    layer = attn + C + 2 * H * FF + 4 * H  # + the KV latent's norm, the MLP, two norms
    assert float(lite.num_params()) == pytest.approx(2 * layer + 2 * V * H)
    down = H * (C + DR)  # replicated on both GPUs of tp 2
    up = (H * A * (DN + DR) + C * A * (DN + DV) + A * DV * H) / 2
    want = 2 * (2 * (down + up + H * FF) + 2 * (4 * H + C)) + 2 * 2 * V * H / 2
    assert float(dp.weight_bytes_per_gpu(lite, dp.InferencePlan(tp=2))) == pytest.approx(want)
