"""ZeRO-2 keeps only its shard of the gradients, so under gradient accumulation it must
reduce-scatter every micro-batch's gradients (DeepSpeed stage 2, FSDP SHARD_GRAD_OP), where
ZeRO-1 (a full gradient buffer, Megatron's distributed optimizer) reduces once per step."""

import diffperf as dp


def _dp_comm(gpt3, system, eff, zero, global_batch):
    plan = dp.TrainingPlan(tp=8, pp=8, dp=16, vp=1, global_batch=global_batch,
                           recompute="selective", zero=zero, overlap_dp=0)
    return float(dp.train_step(gpt3, system, plan, eff).dp_comm_time)


def test_zero2_pays_one_reduce_scatter_per_micro_batch(gpt3, dgx_a100, eff):
    """Without overlap: ZeRO-1's DP time (one reduce-scatter + one all-gather) does not depend
    on the micro-batch count m; ZeRO-2's grows by one reduce-scatter per micro-batch, so
    zero2 - zero1 = (m - 1) x rs, with rs the slope of zero2 in m."""
    # 16 DP ranks, micro-batch 1: m = global batch / 16.
    z1 = {gb: _dp_comm(gpt3, dgx_a100, eff, 1, gb) for gb in (256, 512)}
    z2 = {gb: _dp_comm(gpt3, dgx_a100, eff, 2, gb) for gb in (256, 512)}
    assert z1[256] == z1[512] > 0
    rs = (z2[512] - z2[256]) / (32 - 16)
    assert rs > 0
    assert abs((z2[256] - z1[256]) - 15 * rs) < 1e-6 * z2[256]
    assert abs((z2[512] - z1[512]) - 31 * rs) < 1e-6 * z2[512]


def test_zero2_still_shards_the_gradient_memory(gpt3, dgx_a100, eff):
    plans = [dp.TrainingPlan(tp=8, pp=8, dp=16, vp=1, global_batch=256, recompute="selective",
                             zero=z) for z in (1, 2)]
    m1, m2 = (dp.train_step(gpt3, dgx_a100, p, eff).memory for p in plans)
    assert abs(float(m2.gradients) * 16 - float(m1.gradients)) < 1e-6 * float(m1.gradients)
