"""MFU and HFU are ratios of counted FLOPs to the tensor peak: at most 100 % where the count
is the work the kernels do (issue 41 item 6), and explained where a convention makes them pass
it (a causal flash kernel does half the attention product the count includes)."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import pytest

import diffperf as dp
from diffperf.training import utilisation_notes

V100 = dp.system("dgx-v100")
V100_EFF = dp.default_efficiency("v100-sxm2-32gb")


def _model(seq, hidden=512):
    return dp.Transformer(layers=4, hidden=hidden, heads=hidden // 128, kv_heads=hidden // 128,
                          ffn_hidden=4 * hidden, vocab=32000, seq_len=seq)


@pytest.mark.parametrize("flops_fp32_scale", [1.0, 0.3])
def test_fp32_unfused_attention_runs_at_the_fp32_rate(step, flops_fp32_scale):
    """V100 fp32, no flash: the score GEMMs were costed at the bf16 tensor rate (8x V100's fp32
    rate), so with attention dominating (8k tokens, hidden 512) and 0.3x the fp32 FLOP/s the
    MFU came out 109 % (190 % at 32k). Multiplying in fp32 they cannot pass the fp32 peak."""
    system = eqx.tree_at(lambda s: s.accelerator.flops_fp32, V100,
                         V100.accelerator.flops_fp32 * flops_fp32_scale)
    plan = dp.TrainingPlan(global_batch=1, precision="fp32", flash_attention=0,
                           recompute="none")
    r = step(_model(8192), system, plan, V100_EFF)
    assert int(r.reason) == 0
    assert 0.3 < float(r.mfu) <= 1.0
    # and the attention core follows the fp32 rate: 0.3x the rate, at least ~2x the time
    if flops_fp32_scale == 0.3:
        full = step(_model(8192), V100, plan, V100_EFF)
        assert float(r.compute_time) > 2.0 * float(full.compute_time)


def _ideal(eff):
    """Every efficiency 1 and no overheads: only the count and the peak remain."""
    fields = ("matmul_peak", "matmul_lowp", "attention", "vector", "hbm", "l2", "nvlink",
              "all_to_all", "scaleout")
    eff = eqx.tree_at(lambda e: [getattr(e, f) for f in fields], eff,
                      [1.0 + 0.0 * getattr(eff, f) for f in fields])
    zero = jnp.float32(0.0)  # an array leaf, as everywhere else: the session's step serves it
    return eqx.tree_at(lambda e: (e.kernel_overhead, e.collective_overhead), eff, (zero, zero))


@pytest.mark.parametrize("sysname,precision", [("dgx-v100", "fp32"), ("dgx-v100", "fp16"),
                                               ("dgx-h100", "bf16"), ("dgx-b200", "fp8")])
@pytest.mark.parametrize("seq", [2048, 32768])
def test_without_flash_the_count_never_passes_the_peak(step, sysname, precision, seq):
    """An ideal GPU (every efficiency 1, no overheads) without flash attention does exactly the
    counted work, so MFU <= 100 %; at 32k tokens attention is most of it."""
    eff = _ideal(dp.Efficiency())
    plan = dp.TrainingPlan(global_batch=1, precision=precision, flash_attention=0,
                           recompute="none")
    r = step(_model(seq), dp.system(sysname), plan, eff)
    assert int(r.reason) in (0, 10)
    assert 0.0 < float(r.mfu) <= 1.0 + 1e-6, float(r.mfu)
    assert utilisation_notes(float(r.mfu), float(r.hfu), 0.0) == []


def test_a_flash_kernel_can_pass_100_percent_and_is_explained(step):
    """With flash attention at its peak (efficiency 1) and 128k tokens, the count (full s x s,
    backward 2x) exceeds the work (causal half, backward 2.5x): MFU -> 3 / (0.5 * 3.5) = 171 %
    as attention dominates. The note says so."""
    eff = _ideal(dp.Efficiency())
    plan = dp.TrainingPlan(global_batch=1, precision="bf16", recompute="none")
    r = step(_model(131072), dp.system("dgx-h100"), plan, eff)
    mfu = float(r.mfu)
    assert 1.0 < mfu < 3.0 / 1.75 + 1e-6
    (note,) = utilisation_notes(mfu, float(r.hfu), 1.0)
    assert "full s x s" in note and "flash" in note and f"{mfu:.0%}" in note
