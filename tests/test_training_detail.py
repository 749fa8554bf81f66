"""`training_detail`: the full breakdown of a training step (issue 40, part 3). The physics is
pinned by hand formulas; the bookkeeping by the step's own report (exposed terms), by
hidden + exposed = link, and by jit / vmap equal to a loop."""

from __future__ import annotations

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffperf as dp
from diffperf.cli import main
from diffperf.costs import all_gather, all_reduce
from diffperf.costs._roofline import OP_RESOURCES
from diffperf.training._detail import (
    COMM_TERMS,
    HEAD_OPS,
    LAYER_COLLECTIVES,
    LAYER_OPS,
    detail_of_report,
)
from diffperf.training._layer import layer_costs
from diffperf.training._terms import dp_collectives, local_params, zero3_collectives
from diffperf.validation import stack

# The slow set (CI runs it): one ~20-s compilation of the batched detail, and the CLI's.
pytestmark = pytest.mark.slow

# A small GPT (ffn 4h, MHA, no gated MLP): h = 1024, a = 16, s = 512, L = 8, V = 32000.
H, A, S, L, V = 1024.0, 16.0, 512.0, 8.0, 32000.0
GPT = dp.Transformer(layers=L, hidden=H, heads=A, kv_heads=A, ffn_hidden=4 * H, vocab=V,
                     seq_len=S)
SYSTEM = dp.system("dgx-h100")

# Every configuration of the file, evaluated in one jit(vmap) call (one compilation): the
# hand-formula plans on the small GPT, then further plans, MoE ones included.
BASE_DP = dict(tp=1, pp=2, dp=4, micro_batch=1, global_batch=32)
CASES = {
    "flops": (GPT, dict(tp=2, micro_batch=2, global_batch=8, dp=1, flash_attention=0,
                        recompute="none")),
    "flops_flash": (GPT, dict(tp=2, micro_batch=2, global_batch=8, dp=1, flash_attention=1,
                              recompute="none")),
    "tp_sp0": (GPT, dict(tp=4, pp=2, dp=1, micro_batch=1, global_batch=16, sequence_parallel=0,
                         recompute="none")),
    "tp_sp1": (GPT, dict(tp=4, pp=2, dp=1, micro_batch=1, global_batch=16, sequence_parallel=1,
                         recompute="none")),
    "zero0": (GPT, dict(zero=0, **BASE_DP)),
    "zero1": (GPT, dict(zero=1, **BASE_DP)),
    "zero2": (GPT, dict(zero=2, **BASE_DP)),
    "zero1_bf16_grads": (GPT, dict(zero=1, fp32_gradients=0, **BASE_DP)),
    "vp_selective": (GPT, dict(tp=2, pp=2, dp=2, micro_batch=1, global_batch=16, vp=2,
                               sequence_parallel=1, recompute="selective", flash_attention=0)),
    "cp_full_zero2": (GPT, dict(tp=4, pp=1, dp=2, cp=2, micro_batch=1, global_batch=8,
                                sequence_parallel=1, recompute="full", zero=2)),
    "zero3_per_matrix": (GPT, dict(tp=1, pp=2, dp=4, micro_batch=1, global_batch=32, zero=3,
                                   zero3_per_matrix=1)),
    "zero3_offload": (GPT, dict(tp=2, pp=1, dp=4, micro_batch=2, global_batch=32, zero=3,
                                offload_layers=4, offload_weights=1, offload_optimizer=1)),
    "zero2_optimizer_offload": (GPT, dict(zero=2, offload_optimizer=0.5, **BASE_DP)),
    "mixtral_overlap_ep": (dp.model("mixtral-8x7b"), dict(
        tp=2, pp=4, dp=4, ep=4, micro_batch=1, global_batch=32, sequence_parallel=1,
        overlap_ep=1)),
    "qwen3_moe_etp1": (dp.model("qwen3-30b-a3b"), dict(
        tp=2, pp=2, dp=8, ep=8, expert_tp=1, micro_batch=1, global_batch=32,
        sequence_parallel=1, zero=1)),
}
NAMES = list(CASES)


def _models_plans(names):
    return ([CASES[n][0] for n in names], [dp.TrainingPlan(**CASES[n][1]) for n in names])


@pytest.fixture(scope="module")
def batch():
    """(detail, report, layer times, the step's DP collectives) of every case, batched along
    axis 0."""
    models, plans = _models_plans(NAMES)
    eff = dp.default_efficiency()

    @eqx.filter_jit
    def both(model, plan):
        params = local_params(model, plan)
        dp_total = jnp.where(plan.zero >= 3,
                             zero3_collectives(model, plan, SYSTEM.network, eff, params),
                             dp_collectives(model, plan, SYSTEM.network, eff, params))
        report = dp.train_step(model, SYSTEM, plan, eff)
        return (detail_of_report(model, SYSTEM, plan, eff, report), report,
                layer_costs(model, plan, SYSTEM, eff), dp_total)

    return jax.device_get(jax.vmap(both)(stack(models), stack(plans)))


def _row(tree, i):
    return jax.tree.map(lambda x: np.asarray(x)[i], tree)


def _get(batch, name):
    """(detail, report, layer times, DP collectives) of one case."""
    i = NAMES.index(name)
    return tuple(_row(x, i) for x in batch)


def test_layer_forward_flops_match_the_hand_formula(batch):
    """Per GPU (tp = 2), one micro-batch of b = 2: the weight GEMMs do 24 b s h^2 / t FLOPs
    (qkv 6, output 2, MLP 8 + 8, in b s h^2 / t units), the unfused attention 4 b s^2 h / t
    (QK^T and AV at the full s x s: the Megatron convention of `_flops`), the softmax 8 FLOPs
    per score (b a/t s^2 scores), the element-wise kernels 22 per norm element (b s h: two
    layer norms of 8, two residual adds of 3) and 8 per activation element (b s 4h / t)."""
    b, t = 2.0, 2.0
    plan = dp.TrainingPlan(**CASES["flops"][1])
    d = _get(batch, "flops")[0]
    f = {k: float(c.flops) for k, c in d.forward.items()}
    assert f["qkv"] == pytest.approx(6 * b * S * H * H / t, rel=1e-6)
    assert f["out_proj"] == pytest.approx(2 * b * S * H * H / t, rel=1e-6)
    assert f["mlp_up"] == f["mlp_down"] == pytest.approx(8 * b * S * H * H / t, rel=1e-6)
    gemms = f["qkv"] + f["out_proj"] + f["mlp_up"] + f["mlp_down"]
    assert gemms == pytest.approx(24 * b * S * H * H / t, rel=1e-6)
    attention = f["attention_scores"] + f["attention_values"]
    assert attention == pytest.approx(4 * b * S * S * H / t, rel=1e-6)
    vector = 8 * b * (A / t) * S * S + 22 * b * S * H + 8 * b * S * 4 * H / t
    assert sum(f.values()) == pytest.approx(
        24 * b * S * H * H / t + 4 * b * S * S * H / t + vector, rel=1e-6)
    # the model-FLOP formula of `_flops` (MFU numerator) counts the same layer GEMMs and
    # attention: 3 x forward per token, over all GPUs of the job
    per_token_layer = (24 * H * H + 4 * S * H)
    assert float(dp.model_flops_per_step(GPT, plan)) == pytest.approx(
        8 * S * 3 * (L * per_token_layer + 2 * H * V), rel=1e-6)
    assert (gemms + attention) * t / (b * S) == pytest.approx(per_token_layer, rel=1e-6)
    # backward = 2 x forward FLOPs for GEMMs; no recomputation
    assert float(d.backward["qkv"].flops) == pytest.approx(2 * f["qkv"], rel=1e-6)
    assert sum(float(c.flops) for c in d.recompute.values()) == 0.0
    # a flash kernel skips the masked half of the scores: 2 b s^2 h / t
    flash = _get(batch, "flops_flash")[0]
    assert float(flash.forward["attention_flash"].flops) == pytest.approx(
        2 * b * S * S * H / t, rel=1e-6)
    assert float(flash.forward["attention_scores"].flops) == 0.0


@pytest.mark.parametrize("sp", [0, 1])
def test_tp_messages_are_the_layer_activations(batch, sp):
    """The TP collectives of a GPT layer move b s h activations of 2 B (bf16) per call: two
    all-reduces per pass (after attention and after the MLP), or with sequence parallelism a
    reduce-scatter and an all-gather of the same full message; 2 passes (forward, backward).
    Each call costs the collective of `diffperf.costs` on that message."""
    b, t, gb, pp = 1.0, 4.0, 16.0, 2.0
    d = _get(batch, f"tp_sp{sp}")[0]
    msg = 2.0 * b * S * H
    tp = d.comm["tp"]
    per_reduction = 2.0 if sp else 1.0
    calls = gb / b * (L / pp) * 2 * 2 * per_reduction  # m L passes reductions
    assert float(tp.message_bytes) == pytest.approx(msg, rel=1e-6)
    assert float(tp.calls) == pytest.approx(calls, rel=1e-6)
    assert float(tp.bytes) == pytest.approx(calls * msg, rel=1e-6)
    eff = dp.default_efficiency()
    one = (all_gather(SYSTEM.network, eff, msg, t) if sp else
           all_reduce(SYSTEM.network, eff, msg, t))
    assert float(tp.link) == pytest.approx(calls * float(one), rel=1e-5)
    assert float(d.forward["tp_reduction"].network_bytes) == pytest.approx(
        2 * per_reduction * msg, rel=1e-6)
    assert OP_RESOURCES[int(d.forward["tp_reduction"].bound)] == "network"


def test_dp_gradient_message_is_the_stage_parameters(batch):
    """tp = 1, pp = 2: a GPU of the first stage holds L/pp layers of 12 h^2 + 6 h parameters
    (4 h^2 attention + 2 h biases, 8 h^2 MLP, 4 h norms) and the V h embedding; ZeRO-1
    reduce-scatters their fp32 gradients (4 B) once per step, then all-gathers the bf16
    parameters (2 B); ZeRO-2 reduce-scatters every micro-batch; ZeRO-0 all-reduces once."""
    params = L / 2 * (12 * H * H + 6 * H) + V * H
    for zero, calls in ((0, 1.0), (1, 1.0), (2, 8.0)):
        d = _get(batch, f"zero{zero}")[0]
        g, w = d.comm["dp_gradients"], d.comm["dp_params"]
        assert float(g.message_bytes) == pytest.approx(4 * params, rel=1e-6)
        assert float(g.calls) == calls
        assert float(w.message_bytes) == pytest.approx(2 * params if zero else 0.0, rel=1e-6)
        assert float(w.calls) == (1.0 if zero else 0.0)
    d = _get(batch, "zero1_bf16_grads")[0]
    assert float(d.comm["dp_gradients"].message_bytes) == pytest.approx(2 * params, rel=1e-6)


@pytest.fixture(scope="module", params=NAMES)
def case(request, batch):
    name = request.param
    model, kw = CASES[name]
    return (model, dp.TrainingPlan(**kw)) + _get(batch, name)


def test_hidden_plus_exposed_is_the_link_time(case):
    d = case[2]
    for name, t in d.comm.items():
        link, hidden, exposed = float(t.link), float(t.hidden), float(t.exposed)
        assert hidden + exposed == pytest.approx(link, rel=1e-5, abs=1e-12), name
        assert -1e-9 <= hidden and -1e-12 <= exposed <= link * (1 + 1e-6) + 1e-12, name
        assert float(t.bytes) == pytest.approx(float(t.message_bytes * t.calls), rel=1e-5)


def test_exposed_parts_sum_to_the_step_terms(case):
    """Each report term is the sum of its terms' exposed parts (the two DP terms share one),
    and the DP link times sum to the step's DP collectives."""
    _, _, d, r, _, dp_total = case
    for field in set(COMM_TERMS.values()):
        exposed = sum(float(d.comm[k].exposed) for k, f in COMM_TERMS.items() if f == field)
        assert exposed == pytest.approx(float(getattr(r, field)), rel=1e-5, abs=1e-12), field
    links = float(d.comm["dp_gradients"].link + d.comm["dp_params"].link)
    assert links == pytest.approx(float(dp_total), rel=1e-5)


def test_pass_times_sum_to_the_layer_times(case):
    _, _, d, _, layer, _ = case
    for name, ops in (("forward", d.forward), ("backward", d.backward),
                      ("recompute", d.recompute)):
        total = sum(float(c.time) for k, c in ops.items() if k not in LAYER_COLLECTIVES)
        assert total == pytest.approx(float(getattr(layer, name)), rel=1e-5, abs=1e-12), name
    assert float(d.layer_compute_time) == pytest.approx(float(layer.compute), rel=1e-5)
    assert list(d.forward) == sorted(LAYER_OPS) and list(d.head) == sorted(HEAD_OPS)
    # the step's FLOPs on this GPU: m (L x layer + head)
    m, n = float(d.micro_batches), float(d.layers)
    head = sum(float(c.flops) for c in d.head.values())
    assert float(d.step_flops) == pytest.approx(m * (n * float(d.layer_flops) + head), rel=1e-5)


def test_jit_and_vmap_equal_a_loop(batch):
    """The jit(vmap) batch equals one configuration at a time (eager)."""
    names = ["vp_selective", "qwen3_moe_etp1"]
    for name, model, plan in zip(names, *_models_plans(names), strict=True):
        single = jax.device_get(dp.training_detail(model, SYSTEM, plan))
        flat_b, tree_b = jax.tree_util.tree_flatten(batch[0])
        flat_s, tree_s = jax.tree_util.tree_flatten(single)
        assert tree_b == tree_s
        i = NAMES.index(name)
        for x, y in zip(flat_b, flat_s, strict=True):
            np.testing.assert_allclose(np.asarray(x)[i], np.asarray(y), rtol=2e-5, atol=1e-12)
    bound = jax.vmap(lambda c: c.bound)(batch[0].forward["qkv"])
    assert bound.shape == (len(NAMES),) and jnp.issubdtype(bound.dtype, jnp.integer)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


TRAIN = ("train", "--model", "gpt-7.5b", "--gpus", "32", "--tp", "4", "--pp", "2", "--vp", "1",
         "--global-batch", "64")


def test_cli_detail(capsys):
    code, text, _ = run(capsys, *TRAIN, "--detail")
    assert code == 0
    for needle in ("per layer", "qkv", "tp_reduction", "message", "link", "hidden", "exposed",
                   "dp_gradients"):
        assert needle in text, needle
    plain = json.loads(run(capsys, *TRAIN, "--json")[1])
    code, out, _ = run(capsys, *TRAIN, "--json", "--detail")
    s = json.loads(out)
    assert code == 0 and "detail" not in plain
    assert {k: v for k, v in s.items() if k != "detail"} == plain
    detail = s["detail"]
    assert set(detail["comm"]) == set(COMM_TERMS)
    tp = detail["comm"]["tp"]
    assert tp["hidden_s"] + tp["exposed_s"] == pytest.approx(tp["link_s"], rel=1e-5)
    assert tp["exposed_s"] == pytest.approx(s["breakdown_s"]["tp_comm_exposed"], rel=1e-6)
    qkv = detail["layer"]["forward"]["qkv"]
    assert qkv["bound"] in OP_RESOURCES and qkv["flops"] > 0 and qkv["time_s"] > 0
    assert set(detail["layer"]) >= {"forward", "backward", "recompute", "flops", "hbm_bytes"}
    assert detail["step"]["flops"] > 0 and set(detail["head"]) == set(HEAD_OPS)
