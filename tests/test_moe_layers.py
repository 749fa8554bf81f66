"""The layer kinds of MoE models beyond routed experts: dense-MLP layers (DeepSeek-MoE and
GLM-4.5's first layers, Qwen-MoE's `mlp_only_layers`) and shared experts (DeepSeek-MoE,
Qwen-MoE, GLM-4.5). Parameters, FLOPs and per-GPU weights checked by hand layer by layer; a
MoE model whose layers are all dense predicts what the dense model does; shared experts are
not dispatched; vmap == loop, gradients, errors.

The expected values are sums over the layers, each written as the layer it is (attention +
either the router and E experts or one dense MLP), never taken from the code."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffperf as dp
from diffperf.feasibility import describe_failure

EFF = dp.Efficiency()
H100 = dp.system("h100-sxm5-80gb")

# 4 layers of h = 1024 with 8 heads of 128 (MHA); MoE layers: 8 gated experts 512 wide, top 2;
# 1 dense layer: a gated MLP 4096 wide.
L, H, E, K, F, FD, V = 4, 1024, 8, 2, 512, 4096, 1000
MOE = dp.Transformer(layers=L, hidden=H, heads=8, kv_heads=8, ffn_hidden=F, vocab=V,
                     seq_len=1024, gated_mlp=1, num_experts=E, experts_per_token=K,
                     dense_layers=1, dense_ffn_hidden=FD, dropout=0)
ATTN = 4 * H * H + 2 * H  # Q, K, V, O and the QKV biases, as `layer_params` counts them
NORMS = 4 * H
MOE_LAYER = ATTN + NORMS + H * E + E * 3 * H * F  # router + all experts
DENSE_LAYER = ATTN + NORMS + 3 * H * FD


def test_parameters_by_hand():
    assert float(MOE.num_params()) == pytest.approx(3 * MOE_LAYER + DENSE_LAYER + 2 * V * H)
    active = 3 * (MOE_LAYER - (E - K) * 3 * H * F) + DENSE_LAYER
    assert float(L * MOE.active_layer_params()) == pytest.approx(active)


def test_training_flops_by_hand():
    B, s = 8, 1024
    plan = dp.TrainingPlan(global_batch=B)
    core = 4 * s * H  # attention QK^T and AV per token (full-square convention)
    moe_fwd = 2 * (4 * H * H + H * E + K * 3 * H * F) + core  # per token, forward
    dense_fwd = 2 * (4 * H * H + 3 * H * FD) + core
    want = 3 * B * s * (3 * moe_fwd + dense_fwd + 2 * H * V)
    assert float(dp.model_flops_per_step(MOE, plan)) == pytest.approx(want, rel=1e-6)


def test_weights_per_gpu_by_hand():
    # Training, tp 2, ep 4 (dp 4), pp 1: dense parts split over tp, expert weights over tp * ep;
    # embedding and output head (untied) on the one stage.
    plan = dp.TrainingPlan(tp=2, dp=4, ep=4, global_batch=16)
    experts = 3 * E * 3 * H * F
    want = (3 * MOE_LAYER + DENSE_LAYER - experts) / 2 + experts / 8 + 2 * V * H / 2
    got = float(dp.training_memory(MOE, plan, EFF).weights) / 2  # 16-bit weights
    assert got == pytest.approx(want, rel=1e-6)
    # Inference, tp 2, bf16: attention and MLP weights split over tp (routers and norms
    # replicated, kept in 16 bit), plus the embedding and LM head shards.
    served = dp.InferencePlan(tp=2)
    sharded = L * 4 * H * H + 3 * E * 3 * H * F + 3 * H * FD
    replicated = 3 * H * E + L * 4 * H
    want = 2 * (sharded / 2 + replicated) + 2 * 2 * V * H / 2
    assert float(dp.weight_bytes_per_gpu(MOE, served)) == pytest.approx(want, rel=1e-6)


def all_dense(model, width):
    return dataclasses.replace(model, dense_layers=model.layers, dense_ffn_hidden=width)


def test_a_moe_model_with_only_dense_layers_predicts_the_dense_model():
    """Every layer dense: the MoE branch must vanish and the dense branch be exactly the dense
    model's MLP (training step, memory and inference)."""
    moe = dp.model("mixtral-8x7b")
    dense = dataclasses.replace(moe, num_experts=1, experts_per_token=1, ffn_hidden=8192)
    moe = all_dense(moe, 8192)
    plan = dp.TrainingPlan(tp=4, pp=2, dp=4, micro_batch=1, global_batch=64, recompute=1,
                           sequence_parallel=1)
    a, b = dp.train_step(dense, H100, plan, EFF), dp.train_step(moe, H100, plan, EFF)
    for f in ("step_time", "compute_time", "tp_comm_time", "dp_comm_time"):
        assert float(getattr(b, f)) == pytest.approx(float(getattr(a, f)), rel=1e-5), f
    assert float(b.memory.total) == pytest.approx(float(a.memory.total), rel=1e-5)
    served = dp.InferencePlan(tp=2, batch=8, input_len=1000, output_len=200)
    a, b = dp.infer(dense, H100, served, EFF), dp.infer(moe, H100, served, EFF)
    for f in ("ttft", "tpot"):
        assert float(getattr(b, f)) == pytest.approx(float(getattr(a, f)), rel=1e-5), f
    assert float(b.memory.weights) == pytest.approx(float(a.memory.weights), rel=1e-6)


def test_dense_first_layers_of_a_sparse_model_cost_more_at_batch_one():
    """Batch-1 decode reads the weights a token touches: a dense layer reads its whole MLP
    (here 4x the two active experts' weights), so more dense layers are never faster."""
    served = dp.InferencePlan(batch=1, input_len=256, output_len=64)
    base = dp.model("mixtral-8x7b")  # experts 14336 wide, top 2
    tpot = [float(dp.infer(dataclasses.replace(base, dense_layers=n, dense_ffn_hidden=4 * 28672),
                           H100, served, EFF).tpot) for n in (0, 1, 4, 16)]
    assert np.all(np.diff(tpot) > 0), tpot


def test_vmap_over_dense_layers_equals_a_loop():
    counts = jnp.array([0.0, 1.0, 2.0, 3.0])
    served = dp.InferencePlan(batch=4, input_len=512, output_len=128)

    def tpot(n):
        return dp.infer(dataclasses.replace(MOE, dense_layers=n), H100, served, EFF).tpot

    np.testing.assert_allclose(np.asarray(jax.vmap(tpot)(counts)),
                               [float(tpot(n)) for n in counts], rtol=1e-5)


def test_step_time_gradient_in_the_dense_share_matches_finite_differences():
    """The layer mix is linear in `dense_layers`, so its gradient is exact; (the GEMM shapes
    themselves have straight-through tile ceilings, which finite differences would see as
    jumps). Evaluated under jit: the count is a tracer, so fractional probes are allowed."""
    model = dataclasses.replace(dp.model("mixtral-8x7b"), dense_layers=4, dense_ffn_hidden=16384)
    plan = dp.TrainingPlan(tp=4, dp=8, ep=8, micro_batch=1, global_batch=64, recompute=1,
                           sequence_parallel=1)

    @jax.jit
    def step(n):
        return dp.train_step(dataclasses.replace(model, dense_layers=n), H100, plan,
                             EFF).step_time

    n0, dn = 4.0, 0.5
    grad = float(jax.grad(step)(jnp.float32(n0)))
    fd = (float(step(n0 + dn)) - float(step(n0 - dn))) / (2 * dn)
    # a dense MLP 16384 wide does less than a token's 2 experts 14336 wide, with no all-to-all
    assert grad < 0
    assert grad == pytest.approx(fd, rel=1e-2)


def test_bad_dense_layers_are_named():
    with pytest.raises(ValueError, match="dense_layers=5 exceeds layers=4"):
        dataclasses.replace(MOE, dense_layers=5)
    with pytest.raises(ValueError, match="needs a MoE model"):
        dataclasses.replace(dp.model("llama2-7b"), dense_layers=1)
    with pytest.raises(ValueError, match="dense_ffn_hidden"):
        dataclasses.replace(MOE, dense_ffn_hidden=-1)
    odd = dataclasses.replace(MOE, dense_ffn_hidden=4100)  # 4100 / 8 is not whole
    plan = dp.TrainingPlan(tp=8, global_batch=8)
    r = dp.train_step(odd, H100, plan, EFF)
    assert not bool(r.feasible) and int(r.reason) == 3
    assert "dense_ffn_hidden=4100" in describe_failure(3, odd, plan)
    r = dp.infer(odd, H100, dp.InferencePlan(tp=8), EFF)
    assert not bool(r.feasible) and int(r.reason) == 3


FS = 1024  # a shared expert 1024 wide in the three MoE layers
SHARED = dataclasses.replace(MOE, shared_ffn_hidden=FS)
MOE_LAYER_S = MOE_LAYER + 3 * H * FS


def test_shared_expert_parameters_and_flops_by_hand():
    assert float(SHARED.num_params()) == pytest.approx(3 * MOE_LAYER_S + DENSE_LAYER + 2 * V * H)
    active = 3 * (MOE_LAYER_S - (E - K) * 3 * H * F) + DENSE_LAYER
    assert float(L * SHARED.active_layer_params()) == pytest.approx(active)
    B, s = 8, 1024
    core = 4 * s * H
    moe_fwd = 2 * (4 * H * H + H * E + K * 3 * H * F + 3 * H * FS) + core
    dense_fwd = 2 * (4 * H * H + 3 * H * FD) + core
    want = 3 * B * s * (3 * moe_fwd + dense_fwd + 2 * H * V)
    plan = dp.TrainingPlan(global_batch=B)
    assert float(dp.model_flops_per_step(SHARED, plan)) == pytest.approx(want, rel=1e-6)


def test_shared_expert_weights_are_split_over_tp_not_ep():
    plan = dp.TrainingPlan(tp=2, dp=4, ep=4, global_batch=16)
    experts = 3 * E * 3 * H * F  # routed experts only: split over tp * ep
    want = (3 * MOE_LAYER_S + DENSE_LAYER - experts) / 2 + experts / 8 + 2 * V * H / 2
    got = float(dp.training_memory(SHARED, plan, EFF).weights) / 2
    assert got == pytest.approx(want, rel=1e-6)
    sharded = L * 4 * H * H + 3 * E * 3 * H * F + 3 * 3 * H * FS + 3 * H * FD
    replicated = 3 * H * E + L * 4 * H
    want = 2 * (sharded / 2 + replicated) + 2 * 2 * V * H / 2
    served = dp.InferencePlan(tp=2)
    assert float(dp.weight_bytes_per_gpu(SHARED, served)) == pytest.approx(want, rel=1e-6)


def test_shared_experts_are_not_dispatched():
    """With tp = 1 the only layer communication is the expert-parallel all-to-all: a shared
    expert adds compute but no traffic. Batch-1 decode reads its weights every step."""
    base = dp.model("mixtral-8x7b")
    shared = dataclasses.replace(base, shared_ffn_hidden=14336)
    plan = dp.TrainingPlan(tp=1, dp=8, ep=8, micro_batch=1, global_batch=64, recompute=2)
    a, b = dp.train_step(base, H100, plan, EFF), dp.train_step(shared, H100, plan, EFF)
    assert float(a.tp_comm_time) == 0 and float(a.ep_comm_time) > 0
    assert float(b.ep_comm_time) == pytest.approx(float(a.ep_comm_time), rel=1e-6)
    assert float(b.compute_time) > 1.1 * float(a.compute_time)
    served = dp.InferencePlan(tp=2, batch=1, input_len=256, output_len=64)
    tpot = [float(dp.infer(dataclasses.replace(base, shared_ffn_hidden=w), H100, served,
                           EFF).tpot) for w in (0, 1024, 14336, 28672)]
    assert np.all(np.diff(tpot) > 0), tpot


def test_bad_shared_experts_are_named():
    with pytest.raises(ValueError, match="shared_ffn_hidden > 0 needs a MoE model"):
        dataclasses.replace(dp.model("llama2-7b"), shared_ffn_hidden=1024)
    odd = dataclasses.replace(SHARED, shared_ffn_hidden=1028)
    plan = dp.TrainingPlan(tp=8, global_batch=8)
    r = dp.train_step(odd, H100, plan, EFF)
    assert not bool(r.feasible) and int(r.reason) == 3
    assert "shared_ffn_hidden=1028" in describe_failure(3, odd, plan)


def test_batched_models_with_and_without_shared_experts_equal_a_loop():
    """Batched (traced) widths: a model without a shared expert next to models with one must
    still be finite and equal to its own prediction."""
    widths = jnp.array([0.0, 1024.0, 4096.0])
    plan = dp.TrainingPlan(tp=2, dp=2, ep=2, global_batch=8)
    served = dp.InferencePlan(tp=2, batch=4, input_len=512, output_len=64)

    def both(w):
        m = dataclasses.replace(SHARED, shared_ffn_hidden=w)
        return jnp.stack([dp.train_step(m, H100, plan, EFF).step_time,
                          dp.infer(m, H100, served, EFF).tpot])

    batched = np.asarray(jax.vmap(both)(widths))
    assert np.all(np.isfinite(batched))
    np.testing.assert_allclose(batched, [np.asarray(both(w)) for w in (0.0, 1024.0, 4096.0)],
                               rtol=1e-5)


def test_routed_expert_gemms_launch_one_kernel_per_local_expert():
    """Transformer Engine's grouped expert GEMMs (Megatron-core's grouped-GEMM expert MLP) run
    one cuBLAS GEMM per local expert, each with its own launch and tail. d step / d
    kernel_overhead counts the launches: on one GPU (no collectives), doubling the experts from
    8 to 16 adds, per added expert, per MoE layer (3 of the 4) and per micro-batch (4), the two
    forward GEMMs (up and down projection) and their four backward GEMMs (data and weight
    gradients): 4 * 3 * 6 * 8 = 576 launches."""
    import equinox as eqx
    plan = dp.TrainingPlan(global_batch=4, micro_batch=1, recompute="none")

    def launches(model):
        def step(overhead):
            eff = eqx.tree_at(lambda e: e.kernel_overhead, EFF, overhead)
            return dp.train_step(model, H100, plan, eff).step_time
        return float(jax.grad(step)(jnp.asarray(2e-6)))

    sixteen = dataclasses.replace(MOE, num_experts=16)
    assert launches(sixteen) - launches(MOE) == pytest.approx(4 * 3 * 6 * 8, rel=1e-9)
    # a fused grouped GEMM (CUTLASS / cuBLASLt grouped, DeepGEMM) is one launch at any count
    plan = dataclasses.replace(plan, fused_expert_gemm=1)
    assert launches(sixteen) == pytest.approx(launches(MOE), rel=1e-12)
