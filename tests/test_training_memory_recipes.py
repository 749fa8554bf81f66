"""Memory accounting beyond Korthikanti's GPT, checked by hand: dropout-free models, FP8 copies of
GEMM inputs, fp8 weights, 16-bit gradients, block recompute of some layers, activation offload."""

from __future__ import annotations

import json
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest

import diffperf as dp
from diffperf.specs import transformer_from_hf_config
from diffperf.training import in_flight_factor, training_memory
from diffperf.validation import read_benchmarks, train_specs

S, T = 2048, 8
H, A, L = 12288, 96, 96  # GPT-3 175B: f = 4h, MHA


def _gpt(dropout=1):
    return dp.Transformer(layers=L, hidden=H, heads=A, kv_heads=A, ffn_hidden=4 * H, vocab=51200,
                          seq_len=S, dropout=dropout)


def _plan(**kw):
    base = dict(tp=T, pp=8, dp=1, micro_batch=1, global_batch=64, sequence_parallel=1,
                recompute="none", flash_attention=0)
    base.update(kw)
    return dp.TrainingPlan(**base)


def test_dropout_free_layer_drops_masks_and_score_dropout():
    """Without dropout: Korthikanti's 34 loses the two 1-byte masks (32) and 5as/h becomes 2as/h
    (softmax output only)."""
    sbh = S * H
    got = float(dp.activation_bytes_per_layer(_gpt(dropout=0), _plan()))
    np.testing.assert_allclose(got, sbh / T * (32 + 2 * A * S / H), rtol=1e-5)
    with_dropout = float(dp.activation_bytes_per_layer(_gpt(dropout=1), _plan()))
    np.testing.assert_allclose(with_dropout, sbh / T * (34 + 5 * A * S / H), rtol=1e-5)


def test_dropout_free_model_has_no_embedding_mask(eff):
    """The input-embedding dropout mask (s b h p / t) is Korthikanti's only non-layer term."""
    plan = _plan(recompute="selective")
    drop = float(training_memory(_gpt(1), plan, eff).activations)
    free = float(training_memory(_gpt(0), plan, eff).activations)
    sbh = S * H
    np.testing.assert_allclose(drop - free, sbh / T * 2 * L + sbh * 8 / T, rtol=1e-5)


@pytest.mark.parametrize("precision,q", [("fp8", 1.0), ("fp4", 0.5625)])
def test_fp8_keeps_low_precision_copies_of_gemm_inputs(precision, q):
    """SP + flash: 16-bit 34 sbh/t. FP8 (TE): QKV and MLP inputs 2 -> q, the second MLP GEMM's
    input 2 * 4 -> q * 4 (f = 4h), and the output projection adds a q copy next to the 16-bit
    flash-attention output: 34 - 2 (2 - q) - 4 (2 - q) + q. NVFP4 copies are 4-bit values
    plus one 8-bit scale per 16 of them: q = (16 x 4 + 8) / 16 / 8 = 0.5625 B."""
    plan = _plan(flash_attention=1, recompute="selective", precision=precision)
    got = float(dp.activation_bytes_per_layer(_gpt(), plan))
    want = S * H / T * (34 - 2 * (2 - q) - 4 * (2 - q) + q)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    if precision == "fp8":
        np.testing.assert_allclose(got, S * H / T * 29, rtol=1e-5)


def test_fp8_weights_and_16bit_gradients(gpt3, eff):
    """fp8 recipes hold 1-byte weights, fp4 (NVFP4) recipes bf16 ones; fp32_gradients=0 holds
    2-byte gradients."""
    t, p, d = 8, 8, 4
    n = (L / p * 12 * H * H + 51200 * H) / t
    fp8 = training_memory(gpt3, dp.TrainingPlan(tp=t, pp=p, dp=d, global_batch=64,
                                                precision="fp8"), eff)
    np.testing.assert_allclose(float(fp8.weights), 1 * n, rtol=1e-3)
    np.testing.assert_allclose(float(fp8.gradients), 4 * n, rtol=1e-3)
    fp4 = training_memory(gpt3, dp.TrainingPlan(tp=t, pp=p, dp=d, global_batch=64,
                                                precision="fp4"), eff)
    np.testing.assert_allclose(float(fp4.weights), 2 * n, rtol=1e-3)
    g16 = training_memory(gpt3, dp.TrainingPlan(tp=t, pp=p, dp=d, global_batch=64,
                                                fp32_gradients=0), eff)
    np.testing.assert_allclose(float(g16.weights), 2 * n, rtol=1e-3)
    np.testing.assert_allclose(float(g16.gradients), 2 * n, rtol=1e-3)
    # fp32 training keeps fp32 gradients whatever the flag says
    f32 = training_memory(gpt3, dp.TrainingPlan(tp=t, pp=p, dp=d, global_batch=64,
                                                fp32_gradients=0, precision="fp32"), eff)
    np.testing.assert_allclose(float(f32.gradients), 4 * n, rtol=1e-3)


def test_bf16_optimizer_moments(step, gpt22b, dgx_a100, gpt3, eff):
    """Megatron's precision-aware optimizer with bf16 moments: fp32 master (4 B) + two 2-byte
    moments = 8 B of optimizer state per parameter instead of 12, sharded by ZeRO-1; the
    optimizer step moves 8 B less per shard parameter (read and write of both moments), and
    nothing else changes. fp32 training keeps fp32 moments whatever the flag says."""
    t, p, d = 8, 8, 4
    n = (L / p * 12 * H * H + 51200 * H) / t
    kw = dict(tp=t, pp=p, dp=d, global_batch=64)
    full = training_memory(gpt3, dp.TrainingPlan(**kw), eff)
    half = training_memory(gpt3, dp.TrainingPlan(fp32_optimizer_moments=0, **kw), eff)
    np.testing.assert_allclose(float(full.optimizer), 12 * n / d, rtol=1e-3)
    np.testing.assert_allclose(float(half.optimizer), 8 * n / d, rtol=1e-3)
    assert float(half.weights) == float(full.weights)
    assert float(half.gradients) == float(full.gradients)
    f32 = dict(kw, precision="fp32")
    assert float(training_memory(gpt3, dp.TrainingPlan(fp32_optimizer_moments=0, **f32),
                                 eff).optimizer) == pytest.approx(8 * n / d, rel=1e-3)
    # Step time: only the (memory-bound) optimizer step gets shorter, by about 8 of its
    # 24 + 2 g + w + g d = 24 + 8 + 2 + 16 B per shard parameter (fp32 gradients, dp = 4).
    plan = dict(tp=8, pp=1, dp=4, global_batch=16, sequence_parallel=1, recompute="selective")
    r32 = step(gpt22b, dgx_a100, dp.TrainingPlan(**plan), eff)
    r16 = step(gpt22b, dgx_a100, dp.TrainingPlan(fp32_optimizer_moments=0, **plan), eff)
    ratio = float(r16.optimizer_time) / float(r32.optimizer_time)
    assert ratio == pytest.approx((50 - 8) / 50, abs=0.02)
    for f in ("compute_time", "tp_comm_time", "dp_comm_time", "bubble_time"):
        assert float(getattr(r16, f)) == float(getattr(r32, f)), f


def test_16bit_gradients_halve_the_data_parallel_reduction(step, gpt22b, dgx_a100, eff):
    """Plain DDP without overlap: the exposed all-reduce carries half the bytes (a bandwidth-
    bound ring at this size, so close to half the time)."""
    kw = dict(tp=8, pp=1, dp=4, global_batch=16, zero=0, overlap_dp=0, sequence_parallel=1,
              recompute="selective")
    t32 = float(step(gpt22b, dgx_a100, dp.TrainingPlan(**kw), eff).dp_comm_time)
    t16 = float(step(gpt22b, dgx_a100, dp.TrainingPlan(fp32_gradients=0, **kw), eff).dp_comm_time)
    assert 0.45 < t16 / t32 < 0.55, t16 / t32


def test_block_recompute_mixes_full_and_stored_layers(eff):
    """recompute_layers = 3 of a 12-layer chunk (L=96, pp=8): a quarter of the layers keep only
    their input (2 sbh/t), the rest what `recompute` stores; plus one layer rebuilt at a time."""
    m = _gpt()
    plan = _plan(recompute="selective", recompute_layers=3)
    sbh = S * H
    stored, full, rebuilt = 34 * sbh / T, 2 * sbh / T, sbh / T * (34 + 5 * A * S / H)
    per_layer = 0.25 * full + 0.75 * stored
    want = L * per_layer + rebuilt + sbh * 8 / T  # pp stages x L/pp layers, p micro-batches
    np.testing.assert_allclose(float(training_memory(m, plan, eff).activations), want, rtol=1e-5)


def test_block_recompute_of_every_layer_equals_full_recompute(step, gpt22b, dgx_a100, eff):
    kw = dict(tp=8, pp=2, dp=1, global_batch=16, sequence_parallel=1, flash_attention=1)
    full = step(gpt22b, dgx_a100, dp.TrainingPlan(recompute="full", **kw), eff)
    block = step(gpt22b, dgx_a100, dp.TrainingPlan(recompute="none", recompute_layers=24, **kw),
                 eff)
    for f in ("step_time", "recompute_time", "tp_comm_time", "hardware_flops"):
        np.testing.assert_allclose(float(getattr(block, f)), float(getattr(full, f)), rtol=1e-6,
                                   err_msg=f)
    np.testing.assert_allclose(float(block.memory.activations), float(full.memory.activations),
                               rtol=1e-6)
    # A third of the layers: a third of the recompute time (flash: nothing else is recomputed).
    third = step(gpt22b, dgx_a100, dp.TrainingPlan(recompute="none", recompute_layers=8, **kw),
                 eff)
    np.testing.assert_allclose(float(third.recompute_time), float(full.recompute_time) / 3,
                               rtol=1e-5)


def test_offloading_every_layer_keeps_one_layer_in_hbm(eff):
    """pp = 1: all 96 layers offloaded leaves one layer's activations staged in HBM (plus the
    embedding mask and the 16-bit logits, 2 s b v / t); half of them leaves half the layers."""
    m = _gpt()
    sbh = S * H
    stored = 34 * sbh / T
    logits = 2 * S * 51200 / T
    base = dict(pp=1, global_batch=8, recompute="selective")
    allo = training_memory(m, _plan(offload_layers=L, **base), eff)
    np.testing.assert_allclose(float(allo.activations), stored + sbh / T + logits, rtol=1e-5)
    half = training_memory(m, _plan(offload_layers=L // 2, **base), eff)
    np.testing.assert_allclose(float(half.activations),
                               L / 2 * stored + stored + sbh / T + logits, rtol=1e-5)


@pytest.mark.slow
def test_offloaded_activations_must_fit_in_host_memory(step, gpt22b, dgx_a100, eff):
    """Offloaded layers move their stored activations to host memory: pp = 1 holds one
    micro-batch, so the host needs offload_layers x the layer's stored bytes. A host smaller
    than that makes the plan infeasible (reason 12) while HBM still fits."""
    from diffperf.feasibility import explain
    plan = dp.TrainingPlan(tp=8, pp=1, dp=1, global_batch=4, sequence_parallel=1,
                           recompute="selective", offload_layers=24)
    # GPT 22B (h 6144, a 64, s 2048, b 1, t 8, dropout): selective + SP stores 34 s b h / t B.
    stored = 34 * 2048 * 6144 / 8
    r = step(gpt22b, dgx_a100, plan, eff)
    np.testing.assert_allclose(float(r.memory.host), 24 * stored, rtol=1e-6)
    assert int(r.reason) == 0 and bool(r.fits)
    # float32 arrays, not Python floats, as the new leaves: a Python float is a static argument
    # of the shared jit-compiled `step`, and each new value would compile it again
    small = eqx.tree_at(lambda s: s.accelerator.host_memory, dgx_a100,
                        jnp.float32(0.5 * 24 * stored))
    r_small = step(gpt22b, small, plan, eff)
    assert int(r_small.reason) == 12 and not bool(r_small.feasible) and bool(r_small.fits)
    assert float(r_small.step_time) == pytest.approx(float(r.step_time))
    text = explain(12, float(r_small.memory.host), float(small.accelerator.host_memory))
    assert "host memory" in text and f"{24 * stored / 1e9:.1f} GB" in text
    # Without offloading the host holds nothing.
    none = step(gpt22b, small, eqx.tree_at(lambda p: p.offload_layers, plan, jnp.float32(0)),
                eff)
    assert float(none.memory.host) == 0.0 and int(none.reason) == 0


@pytest.mark.slow
def test_offload_time_is_exposed_copy_time(step, gpt22b, dgx_a100, eff):
    """A fast host link hides the copies; a slow one exposes about 2 x copy - (fwd + bwd) per
    offloaded layer and micro-batch; the step stays the sum of its parts."""
    plan = dp.TrainingPlan(tp=8, pp=1, dp=1, global_batch=4, sequence_parallel=1,
                           recompute="selective", offload_layers=24)

    def with_bandwidth(bw):
        # a float32 array leaf (a Python float would recompile the shared `step` per value)
        return eqx.tree_at(lambda s: s.accelerator.host_bandwidth, dgx_a100, jnp.float32(bw))

    fast, slow = with_bandwidth(1e15), with_bandwidth(1e8)
    r_fast, r_slow = step(gpt22b, fast, plan, eff), step(gpt22b, slow, plan, eff)
    assert float(r_fast.offload_time) < 1e-3 * float(r_fast.step_time)
    nbytes = float(dp.activation_bytes_per_layer(gpt22b, plan))
    copy = nbytes / 1e8
    m, layers = 4, 24  # every layer (tp only: one stage), 4 micro-batches
    copies = 2 * copy * m * layers  # out in the forward, back in the backward pass
    # The overlap windows are the layers' own compute: at most all of it is hidden.
    assert copies >= float(r_slow.offload_time) >= copies - float(r_slow.compute_time)
    # Far from the overlap knee every extra second of copying is exposed: halving a slow link's
    # bandwidth adds exactly the copy time again.
    slower = step(gpt22b, with_bandwidth(0.5e8), plan, eff)
    np.testing.assert_allclose(float(slower.offload_time) - float(r_slow.offload_time), copies,
                               rtol=0.01)
    for r in (r_fast, r_slow):
        parts = (r.compute_time + r.tp_comm_time + r.cp_comm_time + r.ep_comm_time
                 + r.pp_comm_time + r.dp_comm_time + r.bubble_time + r.optimizer_time
                 + r.offload_time)
        np.testing.assert_allclose(float(r.step_time), float(parts), rtol=1e-6)
    # Offloading never makes a step faster, and frees memory.
    none = step(gpt22b, dgx_a100, eqx.tree_at(lambda p: p.offload_layers, plan, jnp.float32(0)),
                eff)
    assert float(none.step_time) <= float(r_slow.step_time)
    assert float(none.memory.activations) > float(r_slow.memory.activations)


def test_hf_config_without_dropout_fields_takes_the_family_default(tmp_path):
    """Llama-2's config.json names no dropout: Llama models train without it. An unknown
    family without dropout fields keeps the conservative default (dropout on)."""
    base = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
            "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096}
    for model_type, want in (("llama", 0.0), ("mistral", 0.0), ("somethingnew", 1.0)):
        p = tmp_path / f"{model_type}.json"
        p.write_text(json.dumps(base | {"model_type": model_type}))
        assert float(transformer_from_hf_config(p).dropout) == want, model_type


def test_hf_config_dropout(tmp_path):
    llama = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
             "num_hidden_layers": 32, "intermediate_size": 11008, "vocab_size": 32000,
             "attention_dropout": 0.0, "hidden_act": "silu", "max_position_embeddings": 4096}
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12,
            "vocab_size": 50257, "resid_pdrop": 0.1, "attn_pdrop": 0.1, "embd_pdrop": 0.1,
            "n_positions": 1024}
    for cfg, want in ((llama, 0.0), (gpt2, 1.0)):
        p = tmp_path / f"{cfg['model_type']}.json"
        p.write_text(json.dumps(cfg))
        assert float(transformer_from_hf_config(p).dropout) == want


def test_preset_dropout_flags():
    assert float(dp.model("llama3-70b").dropout) == 0.0
    assert float(dp.model("gpt3-175b").dropout) == 1.0


def test_bad_plan_counts_are_named():
    with pytest.raises(ValueError, match="offload_layers"):
        dp.TrainingPlan(offload_layers=-1)
    with pytest.raises(ValueError, match="recompute_layers"):
        dp.TrainingPlan(recompute_layers=2.5)
    with pytest.raises(ValueError, match="fp32_gradients"):
        dp.TrainingPlan(fp32_gradients=2)


def test_csv_extension_columns(tmp_path):
    """The optional columns reach the specs; a bad count names file, row and column."""
    src = "benchmarks_data/train_calibration.csv"
    rows = {r.id: r for r in read_benchmarks(src)}
    r = rows["mbridge25.09-gb200-llama-3-70b-64g-fp8-fsdp"]
    model, _, plan = train_specs(r)
    assert float(plan.offload_layers) == 40 and float(plan.fp32_gradients) == 0
    assert float(model.dropout) == 0
    korthi = train_specs(rows["imec-korthi-22b-full"])
    assert float(korthi[0].dropout) == 1 and float(korthi[2].fp32_gradients) == 1
    assert float(korthi[2].fp32_optimizer_moments) == 1  # column absent: fp32 moments
    text = Path(src).read_text().splitlines()
    header = text[0].split(",")
    col = header.index("offload_layers")
    bad = tmp_path / "bad.csv"
    import csv
    import io
    rec = next(csv.reader(io.StringIO(text[1])))
    rec[col] = "-3"
    out = io.StringIO()
    csv.writer(out).writerows([header, rec])
    bad.write_text(out.getvalue())
    with pytest.raises(ValueError, match=r"bad.csv.*row 1.*offload_layers"):
        read_benchmarks(bad)


def test_published_runs_fit_in_their_gpus():
    """Every published training run ran, so it fitted: with the recipes' memory settings the
    model must agree, and must not be trivially generous: the recipes tuned to the largest
    setting that fits sit close to capacity. A regression check on real data, not an
    independent test of the physics: the recipe settings (offloading, 16-bit gradients) were
    looked up for the runs that did not fit before."""
    from diffperf.presets import gpu
    from diffperf.validation import predict_train_rows
    predicted, failed = predict_train_rows(read_benchmarks("benchmarks_data/train_calibration.csv"))
    assert failed == []
    over, tight = [], []
    for row, pred, _ in predicted:  # one batched prediction of every row
        use = pred["peak_memory_gb"] * 1e9 / float(gpu(row.values["gpu"]).hbm_capacity)
        if use > 1.0:
            over.append((row.id, round(use, 4)))
        if use > 0.85:
            tight.append(row.id)
    assert over == [], over
    # Nor do the offloading recipes overflow host memory (no HBM or host-memory warning).
    warnings = [(row.id, w) for row, _, w in predicted if w]
    assert warnings == [], warnings
    # The FSDP + offloading recipes and Nemotron-4 340B on H100 use 85-100 % of HBM (of NVML's
    # totals: 87-92 %).
    assert {"mbridge25.09-gb200-llama-3-70b-64g-fp8-fsdp",
            "mbridge25.11-gb300-llama-3-70b-64g-fp8cs-fsdp",
            "nemo24.07-h100-nemotron-4-340b-128g-fp8"} <= set(tight), tight


def test_published_inference_runs_fit():
    """TensorRT-LLM's largest GPT-J batches (512 x 256 and 32 x 4,096 tokens on an 80 GB A100)
    fit, close to capacity: the KV cache alone is 60.1 GB. A regression check on real data (the
    activation peak was revised after these runs were flagged), not an independent test."""
    from diffperf.validation import validate
    result = validate(["benchmarks_data/infer_calibration.csv"])
    assert result["warnings"] == []
    from diffperf.inference import inference_memory
    from diffperf.specs import InferencePlan
    m = dp.model("gpt-j-6b")
    for batch, n in ((512, 128), (32, 2048)):
        plan = InferencePlan(tp=1, batch=batch, input_len=n, output_len=n, weight_precision="fp16")
        total = float(inference_memory(m, plan).total)
        assert 0.95 * 80e9 < total <= 80e9, (batch, total)


def test_search_offloading_only_where_megatron_supports_it():
    """`search train --offload-layers`: offloading plans with pp > 1 or recomputation are
    excluded under their own reason; the ones kept are pp = 1 without recomputation."""
    from diffperf.explore import Grid, search_training
    model = dp.model("llama3-8b")
    system = dp.system("h100-sxm5-80gb")
    grid = Grid({"tp": [1, 2], "pp": [1, 2], "micro_batch": [1, 2], "recompute": [0, 2],
                 "zero": [1, 3], "precision": [2], "fp32_gradients": [0],
                 "offload_layers": [0, 8, 16]})
    res = search_training(model, system, 8, 64, grid=grid, progress=False, top_k=50)
    offload_reason = [k for k in res["reasons"] if "offloading" in k]
    assert offload_reason and res["reasons"][offload_reason[0]] > 0
    for df in (res["top"], res["pareto"]):
        assert "offload_layers" in df and "fp32_gradients" in df
        off = df[df["offload_layers"] > 0]
        assert ((off["pp"] == 1) & (off["recompute"] == "none")).all(), off
        assert (df["fp32_gradients"] == 0).all()
    assert (res["top"]["offload_layers"] > 0).any()  # supported offloading plans are ranked


def test_embedding_and_loss_count_as_pipeline_layers(step, dgx_h100, eff):
    """Llama-3.1 405B (126 layers) at pp 8 with `account_embedding_loss`: 128 slots, so the first
    and last stage hold 15 layers and the middle ones 16 (Megatron's
    account_for_{embedding,loss}_in_pipeline_split); pp 1 and pp 2 are unchanged."""
    from diffperf.feasibility import even_layout
    m = dp.model("llama3-405b")
    kw = dict(tp=8, dp=1, global_batch=64, sequence_parallel=1, recompute="none")
    on = dp.TrainingPlan(pp=8, vp=8, account_embedding_loss=1, **kw)
    off = dp.TrainingPlan(pp=8, vp=8, **kw)
    assert float(on.end_stage_layers(126.0)) == 15.0
    assert float(on.middle_stage_layers(126.0)) == 16.0
    assert float(off.end_stage_layers(126.0)) == 126 / 8
    assert bool(even_layout(m, on)) and not bool(even_layout(m, off))
    # First stage: 15 layers' activations and weights instead of 15.75.
    a_on, a_off = training_memory(m, on, eff), training_memory(m, off, eff)
    per_layer = float(dp.activation_bytes_per_layer(m, on))
    np.testing.assert_allclose(float(a_off.activations) - float(a_on.activations),
                               0.75 * per_layer * float(in_flight_factor(on)), rtol=1e-5)
    assert float(a_on.weights) < float(a_off.weights)
    for pp in (1, 2):
        r_on = step(m, dgx_h100, dp.TrainingPlan(pp=pp, account_embedding_loss=1, **kw), eff)
        r_off = step(m, dgx_h100, dp.TrainingPlan(pp=pp, **kw), eff)
        np.testing.assert_allclose(float(r_on.step_time), float(r_off.step_time), rtol=1e-6)
    # At pp 8 the pacing stage holds 16 layers (no head) or 15 + the head, which is less than
    # the balanced split's 15.75 + head.
    r_on, r_off = step(m, dgx_h100, on, eff), step(m, dgx_h100, off, eff)
    assert float(r_on.compute_time) < float(r_off.compute_time)


def test_layer_count_errors_name_the_field():
    """One rule for the CLI and the CSV: counts are per pipeline chunk, and full recompute
    leaves nothing to offload."""
    from diffperf.specs import layer_count_error
    assert layer_count_error(80, 4, 5, False, 4, 4) is None  # 4 layers per chunk
    assert layer_count_error(80, 4, 5, False, 5, 0).startswith("recompute_layers 5 exceeds")
    assert "offload_layers 40 has no effect with recompute full" in layer_count_error(
        80, 1, 1, True, 0, 40)


def test_logits_of_one_micro_batch_are_held_without_pipeline_parallelism(eff):
    """Without pipeline parallelism the only stage also holds the LM head's 16-bit logits of one
    micro-batch, 2 s b v / t bytes (4.2 GB for a 128K vocabulary at 8,192 tokens and b = 2);
    with pp > 1 they sit on the last stage, not on the first one reported."""
    import equinox as eqx
    import jax.numpy as jnp
    small, big = _gpt(), eqx.tree_at(lambda m: m.vocab, _gpt(), jnp.asarray(51200.0 + 76800))
    for pp, expected in ((1, 2 * S * 2 * 76800 / T), (2, 0.0)):
        plan = _plan(pp=pp, global_batch=16, micro_batch=2, recompute="selective")
        d = float(training_memory(big, plan, eff).activations
                  - training_memory(small, plan, eff).activations)
        np.testing.assert_allclose(d, expected, rtol=1e-5, atol=1.0)
