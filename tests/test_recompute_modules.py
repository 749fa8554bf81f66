"""Selective recomputation of modules (Megatron-core's `recompute_modules` "layernorm",
"moe_act", "mla_up_proj", "mlp"): each trades its forward time, rerun before the backward
pass, for the 16-bit outputs it no longer stores.

Expected values are written from the formulas in the docstrings (the layer norms read and write
tokens x h; a gated activation reads 2 f and writes f per token; Korthikanti's stored bytes),
not read from the code."""

from __future__ import annotations

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy_moe import EFF, H100, MOE, E, F, H, K, L  # noqa: F401

import diffperf as dp
from diffperf.costs._gemm import gemm_cost
from diffperf.costs._roofline import op_cost
from diffperf.training._flops import hardware_flops_per_step
from diffperf.training._layer import layer_costs, module_recompute_ops, module_recompute_time
from diffperf.training._memory import stored_bytes_per_layer

S = 2048  # the toy models' sequence length
#: A dense toy model (gated MLP 4h wide) and an MLA one (DeepSeek-V3's shape, scaled down).
DENSE = dp.Transformer(layers=L, hidden=H, heads=8, kv_heads=8, ffn_hidden=4 * H, vocab=1000,
                       seq_len=S, gated_mlp=1, dropout=0)
MLA = dataclasses.replace(MOE, heads=8, kv_heads=8, head_width=128, kv_lora_rank=256,
                          q_lora_rank=384, rope_head_dim=64, v_head_dim=128)
ACC = H100.accelerator


def _plan(ep=8, **kw):
    base = dict(tp=1, pp=1, dp=8, ep=ep, micro_batch=2, global_batch=64, zero=1,
                precision="bf16")
    return dp.TrainingPlan(**(base | kw))


def test_layer_norms_and_expert_activation_by_hand():
    """Only norms that are modules of their own rerun (Transformer Engine fuses the others
    into the next linear layer): a MoE layer's pre-MLP norm (not a dense model's), MLA's input
    norm. Each reads and writes tokens x h and copies its output back (4 x 2 B per element),
    8 FLOP per element, 2 kernels. The routed experts' activation (gated): reads 2 f, writes f
    and copies f back per routed token at 2 B, 8 FLOP per output element, 2 kernels. Nothing
    when the flags are off."""
    tokens, routed = 2 * S, 2 * S * K
    ops = module_recompute_ops(MOE, _plan(recompute_norms=1), ACC, EFF)
    want = op_cost(ACC, EFF, 8.0 * tokens * H, 8.0 * tokens * H, kernels=2.0)
    assert float(ops["elementwise"].hbm_bytes) == pytest.approx(8.0 * tokens * H, rel=1e-6)
    assert float(ops["elementwise"].time) == pytest.approx(float(want.time), rel=1e-6)
    mla = module_recompute_ops(MLA, _plan(recompute_norms=1), ACC, EFF)["elementwise"]
    assert float(mla.hbm_bytes) == pytest.approx(2 * 8.0 * tokens * H, rel=1e-6)  # both norms
    dense = module_recompute_ops(DENSE, _plan(ep=1, recompute_norms=1), ACC, EFF)
    assert all(float(op.time) == 0.0 for op in dense.values())  # both fused into linears
    act = module_recompute_ops(MOE, _plan(recompute_moe_act=1), ACC, EFF)["elementwise"]
    assert float(act.hbm_bytes) == pytest.approx(2.0 * 5 * routed * F, rel=1e-6)
    assert float(act.flops) == pytest.approx(8.0 * routed * F, rel=1e-6)
    assert float(act.kernels) == 2.0
    off = module_recompute_ops(MOE, _plan(), ACC, EFF)
    assert all(float(op.time) == 0.0 for op in off.values())
    # the clamp of a clamped GLU is rerun with the activation (4 x 2 B per element of R x 2 f)
    clamped = dataclasses.replace(MOE, glu_clamp=1)
    clamp = module_recompute_ops(clamped, _plan(recompute_moe_act=1), ACC, EFF)["moe_eager"]
    assert float(clamp.hbm_bytes) == pytest.approx(8.0 * routed * 2 * F, rel=1e-6)
    # a dense model has no experts' activation to rerun
    dense_act = module_recompute_ops(DENSE, _plan(ep=1, recompute_moe_act=1), ACC, EFF)
    assert float(dense_act["elementwise"].time) == 0.0


def test_mla_up_projections_and_dense_mlp_are_their_gemms():
    """mla_up_proj reruns tokens x (a (d + d_r)) from the 384-wide query latent and tokens x
    a (d + d_v) from the 256-wide KV latent; mlp reruns a dense model's two MLP GEMMs (the
    gated up projection 2 x 4h wide) and its activation."""
    tokens = 2 * S
    ops = module_recompute_ops(MLA, _plan(recompute_mla_up=1), ACC, EFF)
    q_up = gemm_cost(ACC, EFF, tokens, 8 * (128 + 64), 384, 1, act_bytes=2.0)
    kv_up = gemm_cost(ACC, EFF, tokens, 8 * (128 + 128), 256, 1, act_bytes=2.0)
    # element-wise: the two latent norms (384 + 256 per token), RoPE on 8 query heads' and the
    # key's 64 rotary widths, and Q, K, V (8 x (192 + 192 + 128)) copied back: 2 x 2 B each
    latent, rope, qkv = tokens * 640, tokens * 9 * 64, tokens * 8 * 512
    extra = op_cost(ACC, EFF, 8.0 * latent + 6.0 * rope, 4.0 * (latent + rope + qkv),
                    kernels=5.0)
    assert float(ops["qkv"].flops) == pytest.approx(
        2 * tokens * (8 * 192 * 384 + 8 * 256 * 256) + 8.0 * latent + 6.0 * rope, rel=1e-6)
    assert float(ops["qkv"].time) == pytest.approx(float(q_up.time + kv_up.time + extra.time),
                                                   rel=1e-6)
    # without a query latent the query projection from h is rerun in the same checkpoint
    direct = dataclasses.replace(MLA, q_lora_rank=0)
    q_direct = gemm_cost(ACC, EFF, tokens, 8 * 192, H, 1, act_bytes=2.0)
    ops0 = module_recompute_ops(direct, _plan(recompute_mla_up=1), ACC, EFF)
    assert float(ops0["qkv"].flops) == pytest.approx(
        float(q_direct.flops + kv_up.flops) + 8.0 * tokens * 256 + 6.0 * rope, rel=1e-6)
    # a model without MLA has no up-projections
    assert float(module_recompute_ops(MOE, _plan(recompute_mla_up=1), ACC, EFF)["qkv"].time) == 0
    mlp = module_recompute_ops(DENSE, _plan(ep=1, recompute_mlp=1), ACC, EFF)
    f = 4 * H
    assert float(mlp["mlp_up"].flops + mlp["mlp_down"].flops) == pytest.approx(
        2 * tokens * 3 * H * f, rel=1e-6)
    # its activation (read 2 f, write f) and its fused pre-MLP norm (read and write h)
    assert float(mlp["elementwise"].hbm_bytes) == pytest.approx(
        2.0 * 3 * tokens * f + 2.0 * 2 * tokens * H, rel=1e-6)
    # a MoE model without dense-MLP layers has no dense MLP to rerun
    moe_mlp = module_recompute_ops(MOE, _plan(recompute_mlp=1), ACC, EFF)
    assert all(float(op.time) == 0.0 for op in moe_mlp.values())


def test_recompute_enters_the_step_detail_flops_and_not_fully_recomputed_layers():
    """The layer's recompute time grows by exactly `module_recompute_time`; the detail's
    recompute records sum to it; the hardware FLOPs grow by the rerun GEMMs' 2 x active weights
    per token; under full recompute the modules add nothing (the whole layer reruns)."""
    plan = _plan(ep=1, recompute_norms=1, recompute_mlp=1)
    base = layer_costs(DENSE, _plan(ep=1), H100, EFF)
    with_modules = layer_costs(DENSE, plan, H100, EFF)
    extra = float(module_recompute_time(DENSE, plan, ACC, EFF))
    assert extra > 0
    assert float(with_modules.recompute - base.recompute) == pytest.approx(extra, rel=1e-5)
    assert float(with_modules.forward) == pytest.approx(float(base.forward), rel=1e-6)
    detail = dp.training_detail(DENSE, H100, plan, EFF)
    assert sum(float(op.time) for op in detail.recompute.values()) == pytest.approx(
        float(with_modules.recompute), rel=1e-4)
    f = 4 * H
    gained = float(hardware_flops_per_step(DENSE, plan) - hardware_flops_per_step(DENSE,
                                                                                 _plan(ep=1)))
    assert gained == pytest.approx(64 * S * L * 2 * 3 * H * f, rel=1e-5)
    full = _plan(ep=1, recompute="full", recompute_norms=1, recompute_mlp=1)
    assert float(module_recompute_time(DENSE, full, ACC, EFF)) == 0.0
    assert float(layer_costs(DENSE, full, H100, EFF).recompute) == pytest.approx(
        float(layer_costs(DENSE, _plan(ep=1, recompute="full"), H100, EFF).recompute), rel=1e-6)


def test_recomputed_modules_store_less_by_hand():
    """Stored bytes per layer and micro-batch (s b h = 2 x 2048 x 1024, tp 1): MLA's input norm
    frees its down-projections' input (q B per token x h; a MoE layer's pre-MLP norm frees only
    the router's input, which is not counted, a dense model's norms are fused: nothing); the
    MoE activation frees the down projection's input (q x k f per token, q = 2 in bf16, 1 in
    fp8: fp8 linears then save the 16-bit original, which is freed); mla_up_proj frees Q, K, V
    (2 a d_qk + 2 a (d_qk + d_v) B per token); mlp frees a dense MLP's inner tensors
    ((2 x 2 + 2) x 4h B per token)."""
    sbh = 2.0 * S * H

    def saved(model, precision="bf16", **flags):
        ep = 1 if model is DENSE else 8
        return float(stored_bytes_per_layer(model, _plan(ep=ep, precision=precision))
                     - stored_bytes_per_layer(model, _plan(ep=ep, precision=precision, **flags)))

    assert saved(DENSE, recompute_norms=1) == 0.0
    assert saved(MOE, recompute_norms=1) == 0.0
    assert saved(MLA, recompute_norms=1) == pytest.approx(sbh * 2.0, rel=1e-6)
    assert saved(MOE, recompute_moe_act=1) == pytest.approx(sbh * 2.0 * K * F / H, rel=1e-6)
    assert saved(MOE, "fp8", recompute_moe_act=1) == pytest.approx(sbh * 1.0 * K * F / H,
                                                                   rel=1e-6)
    qk, v = 128 + 64, 128
    assert saved(MLA, recompute_mla_up=1) == pytest.approx(
        sbh * (2 * 8 * qk + 2 * 8 * (qk + v)) / H, rel=1e-6)
    assert saved(DENSE, recompute_mlp=1) == pytest.approx(sbh * 6.0 * 4, rel=1e-6)
    # the step's activation memory falls, its time rises
    step = eqx.filter_jit(dp.train_step)
    before, after = step(DENSE, H100, _plan(ep=1), EFF), step(
        DENSE, H100, _plan(ep=1, recompute_mlp=1), EFF)
    assert float(after.memory.activations) < float(before.memory.activations)
    assert float(after.step_time) > float(before.step_time)


def test_partial_recompute_layers_sequence_parallel_and_dense_layers_of_a_moe_model():
    """The modules rerun only on layers not fully recomputed (2 of 4 per chunk: half the
    time); with tp 2 and sequence parallelism the norms touch tokens / 2 each; a MoE model with
    one dense-MLP layer in four reruns that layer's MLP, a quarter of a dense-MLP layer's
    GEMMs per mean layer."""
    plan = _plan(recompute_norms=1, recompute_moe_act=1)
    per_layer = sum(float(op.time) for op in module_recompute_ops(MOE, plan, ACC, EFF).values())
    half = _plan(recompute_norms=1, recompute_moe_act=1, recompute_layers=2)
    assert float(module_recompute_time(MOE, half, ACC, EFF)) == pytest.approx(0.5 * per_layer,
                                                                             rel=1e-6)
    sp = _plan(tp=2, dp=4, ep=8, sequence_parallel=1, recompute_norms=1)
    nosp = _plan(recompute_norms=1)
    assert float(module_recompute_ops(MOE, sp, ACC, EFF)["elementwise"].hbm_bytes) == (
        pytest.approx(0.5 * float(module_recompute_ops(MOE, nosp, ACC, EFF)[
            "elementwise"].hbm_bytes), rel=1e-6))
    mixed = dataclasses.replace(MOE, dense_layers=1, dense_ffn_hidden=4 * H)
    ops = module_recompute_ops(mixed, _plan(recompute_mlp=1), ACC, EFF)
    tokens = 2 * S
    assert float(ops["dense_up"].flops + ops["dense_down"].flops) == pytest.approx(
        0.25 * 2 * tokens * 3 * H * 4 * H, rel=1e-6)
    assert float(ops["mlp_up"].time) == 0.0  # the routed experts are not "mlp"


def test_gradient_and_vmap_over_the_flags():
    """d step / d HBM bandwidth with every module recomputed matches central differences, and
    a vmap over the four flags equals a loop."""
    plan = _plan(recompute_norms=1, recompute_moe_act=1, recompute_mla_up=1)
    step = eqx.filter_jit(dp.train_step)

    def t(bw):
        system = eqx.tree_at(lambda s: s.accelerator.hbm_bandwidth, H100, bw)
        return step(MLA, system, plan, EFF).step_time

    bw = jnp.asarray(float(ACC.hbm_bandwidth))
    eps = 1e-3 * float(bw)
    fd = (float(t(bw + eps)) - float(t(bw - eps))) / (2 * eps)
    assert float(jax.grad(t)(bw)) == pytest.approx(fd, rel=2e-2)
    flags = np.array([[0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [1, 1, 1, 1]],
                     dtype=np.float32)
    names = ("recompute_norms", "recompute_moe_act", "recompute_mla_up", "recompute_mlp")
    base = jax.tree.map(lambda x: jnp.broadcast_to(x, (len(flags),) + jnp.shape(x)), _plan())
    batched = eqx.tree_at(lambda p: [getattr(p, n) for n in names], base,
                          [jnp.asarray(flags[:, i]) for i in range(4)])
    vm = jax.vmap(lambda p: dp.train_step(MLA, H100, p, EFF).step_time)(batched)
    loop = [float(step(MLA, H100, _plan(**{n: float(v) for n, v in zip(names, row)}),
                       EFF).step_time) for row in flags]
    np.testing.assert_allclose(np.asarray(vm), loop, rtol=1e-5)
    assert loop[-1] > loop[0]


def test_cli_names_an_unknown_module_and_runs_a_known_list(capsys):
    from diffperf.cli import main
    base = ["train", "--model", "qwen3-30b-a3b", "--gpu", "h100", "--gpus", "8", "--tp", "1",
            "--pp", "1", "--ep", "8", "--global-batch", "64", "--recompute", "none"]
    assert main(base + ["--recompute-modules", "layernorm,attn"]) != 0
    assert "--recompute-modules: unknown module 'attn'" in capsys.readouterr().err
    assert main(base + ["--recompute-modules", "core_attn"]) != 0
    assert "core_attn is --recompute selective" in capsys.readouterr().err
    assert main(base + ["--recompute-modules", "layernorm,moe_act", "--json"]) == 0
    with_modules = json.loads(capsys.readouterr().out)
    assert main(base + ["--json"]) == 0
    without = json.loads(capsys.readouterr().out)
    assert with_modules["breakdown_s"]["recompute"] > 0 == without["breakdown_s"]["recompute"]
    assert with_modules["memory_gb"]["activations"] < without["memory_gb"]["activations"]
