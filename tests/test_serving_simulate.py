"""The JAX scheduler (`diffperf.serving.simulate`) against the plain-Python reference
(`reference_schedule`): the same admissions and per-request times under both policies, with
and without chunked prefill, KV-limited admission, closed loops and fast-forwarding; vmap over
deployments equals a loop; the iteration cost equals `infer`'s phases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffperf import presets
from diffperf.inference import infer
from diffperf.inference._iteration import iteration_cost, iteration_time
from diffperf.serving import Requests, reference_schedule, simulate, step_bound
from diffperf.serving._report import binned_percentile
from diffperf.serving._simulate import GAP_BINS_PER_DECADE
from diffperf.specs import Engine, InferencePlan


def _affine(tokens, emitting, keys, pairs, has_prefill):
    """An iteration time affine in every argument (fast-forward is exact for it), s."""
    return (0.004 + 2e-6 * tokens + 3e-5 * emitting + 4e-8 * keys + 5e-10 * pairs
            + 0.001 * has_prefill)


class _AffineCost:
    """Stands in for an IterationCost: `iteration_time` is monkeypatched to `_affine`."""


def _run_jax(time_fn, arrival, inp, out, engine, kv, concurrency=0, fast_forward=True):
    import diffperf.serving._simulate as sim
    original = sim._base, sim._with_keys, sim.keys_read
    sim._base = lambda cost, *a: a  # the arguments, for _with_keys
    sim._with_keys = lambda cost, base, keys: time_fn(base[0], base[1], keys, base[3],
                                                     base[4])
    sim.keys_read = lambda cost, ctx: ctx  # no sliding window
    try:
        req = Requests(jnp.asarray(arrival, jnp.float32), jnp.asarray(inp, jnp.float32),
                       jnp.asarray(out, jnp.float32))
        slots = int(engine.max_num_seqs)
        return simulate(None, engine, kv, req, slots, step_bound(inp, engine) * 4,
                        float(concurrency), fast_forward)
    finally:
        sim._base, sim._with_keys, sim.keys_read = original


def _case(seed, n=40):
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.exponential(0.05, n).cumsum() - 0.05)
    arrival = np.maximum(arrival, 0.0)
    inp = rng.integers(1, 300, n)
    out = rng.integers(1, 60, n)
    return arrival, inp, out


CASES = [
    # (seed, max_num_seqs, budget, chunked, policy, kv, concurrency, kv_output_reserve)
    (0, 8, 256, 1, 0, 1e9, 0, 1.0),
    (1, 8, 256, 1, 1, 1e9, 0, 1.0),
    (2, 4, 512, 0, 0, 1e9, 0, 1.0),
    (3, 4, 512, 0, 1, 1e9, 0, 1.0),
    (4, 16, 64, 1, 0, 2000, 0, 1.0),  # KV-limited: about 6 requests fit
    (5, 6, 128, 1, 0, 1e9, 3, 1.0),  # closed loop
    (6, 32, 1024, 1, 1, 3000, 5, 1.0),
    # not chunked, budget barely above the longest prompt: a waiting prompt is blocked by the
    # decoders' tokens until one finishes (fast-forwarded stretches with a prompt pending)
    (8, 8, 300, 0, 0, 1e9, 0, 1.0),
    # KV allocated as contexts grow (vLLM) and half the remaining output held (between that
    # and a reservation): more requests admitted into the same cache
    (4, 16, 64, 1, 0, 2000, 0, 0.0),
    (4, 16, 64, 1, 0, 2000, 0, 0.5),
    (6, 32, 1024, 1, 1, 3000, 5, 0.0),
    # Engine.context_pass: prompts in a pass of their own, then the decode pass (TurboMind
    # v0.1): whole prompts under both policies, chunked, and a closed loop on demand-grown KV
    (2, 4, 512, 0, 0, 1e9, 0, 1.0, 1),
    (3, 4, 512, 0, 1, 1e9, 0, 1.0, 1),
    (0, 8, 256, 1, 0, 1e9, 0, 1.0, 1),
    (1, 8, 256, 1, 1, 1e9, 0, 1.0, 1),
    (6, 32, 1024, 0, 0, 3000, 5, 0.0, 1),
]
@pytest.mark.parametrize("fast_forward", [True, pytest.param(False, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", CASES)
def test_jax_scheduler_equals_reference(case, fast_forward):
    seed, seqs, budget, chunked, policy, kv, concurrency, reserve, *two = case
    context_pass = two[0] if two else 0
    arrival, inp, out = _case(seed)
    ref = reference_schedule(arrival, inp, out, max_num_seqs=seqs,
                             max_num_batched_tokens=budget, chunked_prefill=chunked,
                             policy=policy, kv_capacity=kv, block_size=16,
                             iteration_time=_affine, concurrency=concurrency or None,
                             kv_output_reserve=reserve, context_pass=context_pass)
    engine = Engine(max_num_seqs=seqs, max_num_batched_tokens=budget, chunked_prefill=chunked,
                    policy=policy, block_size=16, kv_output_reserve=reserve,
                    context_pass=context_pass)
    got = _run_jax(_affine, arrival, inp, out, engine, kv, concurrency, fast_forward)
    assert float(got.completed) == 1.0
    for name, want in [("arrival", ref.arrival), ("admit", ref.admit_time),
                       ("first_token", ref.first_token_time), ("finish", ref.finish_time)]:
        np.testing.assert_allclose(np.asarray(getattr(got, name)), want, rtol=2e-5, atol=2e-5,
                                   err_msg=name)
    assert float(got.iterations) == len(ref.iterations)
    assert float(got.kv_peak) == ref.kv_peak
    if fast_forward:  # the stretches collapse iterations into fewer steps
        assert int(got.steps) < len(ref.iterations)
    # the inter-token gaps: as many, as long in all, and their percentiles within one bin
    gaps = ref.inter_token_gaps
    assert len(gaps) == int(np.sum(np.maximum(out - 1, 0)))
    assert float(jnp.sum(got.gap_count)) == pytest.approx(len(gaps), abs=1e-3)
    assert float(jnp.sum(got.gap_sum)) == pytest.approx(gaps.sum(), rel=1e-4)
    width = 10 ** (1 / GAP_BINS_PER_DECADE)
    for q in (50, 90, 99):
        ratio = float(binned_percentile(got.gap_count, got.gap_sum, q)) / np.percentile(gaps, q)
        assert 1 / width <= ratio <= width, (q, ratio)


def test_admission_is_head_of_line_and_fcfs():
    """A big request at the head blocks a small one behind it while the KV cache is short."""
    arrival, inp, out = [0.0, 0.0, 0.0], [100, 700, 10], [20, 20, 20]
    engine = Engine(max_num_seqs=8, max_num_batched_tokens=1024, block_size=16)
    got = _run_jax(_affine, arrival, inp, out, engine, 900.0)
    admit = np.asarray(got.admit)
    # reservations 128, 720, 32: 0 and 1 fit (848 <= 900), 2 waits for a release although
    # its 32 tokens would fit beside them: no: 848 + 32 = 880 <= 900, so all three fit.
    assert admit[2] == 0.0
    got = _run_jax(_affine, arrival, inp, out, engine, 860.0)
    admit = np.asarray(got.admit)
    assert admit[1] == 0.0 and admit[2] > 0.0  # 880 > 860: request 2 waits


def test_kv_output_reserve_by_hand():
    """Two requests of 20 + 40 tokens in a 100-token cache of 16-token blocks. Reserving:
    each holds ceil(60 / 16) 16 = 64 tokens, so the second waits for the first to finish.
    On demand: each holds its prompt and first token, ceil(21 / 16) 16 = 32, both start at
    once, and their contexts grow to 2 x 64 = 128 tokens: past the cache, where an engine
    would preempt (not modelled), which `kv_peak` shows."""
    arrival, inp, out = [0.0, 0.0], [20, 20], [40, 40]
    for reserve, second_admit, peak in ((1.0, "later", 64.0), (0.0, 0.0, 128.0)):
        engine = Engine(max_num_seqs=8, max_num_batched_tokens=256, block_size=16,
                        kv_output_reserve=reserve)
        got = _run_jax(_affine, arrival, inp, out, engine, 100.0)
        admit = np.asarray(got.admit)
        if second_admit == "later":
            assert admit[1] >= float(np.asarray(got.finish)[0]) - 1e-6
        else:
            assert admit[1] == 0.0
        assert float(got.kv_peak) == peak


def test_vmap_over_deployments_equals_loop():
    m = presets.model("llama3-8b")
    sy = presets.system("h100-sxm5-80gb")
    plan = InferencePlan(tp=1, input_len=200, output_len=50)
    arrival, inp, out = _case(7, n=60)
    req = Requests(jnp.asarray(arrival, jnp.float32), jnp.asarray(inp, jnp.float32),
                   jnp.asarray(out, jnp.float32))
    seqs = jnp.array([4.0, 8.0, 16.0])
    budgets = jnp.array([256.0, 512.0, 2048.0])
    bw = jnp.array([1.0, 0.5, 2.0]) * sy.accelerator.hbm_bandwidth

    bound = step_bound(inp, Engine(max_num_batched_tokens=256))

    def one(s, b, hbm):
        import equinox as eqx
        system = eqx.tree_at(lambda x: x.accelerator.hbm_bandwidth, sy, hbm)
        cost = iteration_cost(m, system, plan, b)
        return simulate(cost, Engine(max_num_seqs=s, max_num_batched_tokens=b), 1e6, req, 16,
                        bound)

    batched = jax.jit(jax.vmap(one))(seqs, budgets, bw)
    for i in range(3):
        single = jax.jit(one)(seqs[i], budgets[i], bw[i])
        for name in ("admit", "first_token", "finish"):
            np.testing.assert_allclose(np.asarray(getattr(batched, name))[i],
                                       np.asarray(getattr(single, name)), rtol=1e-6)
    same = jax.jit(jax.vmap(one, in_axes=(None, None, 0)))(8.0, 512.0, bw)
    ttft = np.asarray(same.first_token - same.arrival).mean(axis=1)
    assert ttft[2] < ttft[0] < ttft[1]  # more HBM bandwidth, never slower


@pytest.mark.parametrize("name,gpu,tp,runtime", [
    ("llama3-70b", "h100-sxm5-80gb", 4, None),
    ("llama3-8b", "h100-sxm5-80gb", 1, "vllm"),
    ("mixtral-8x7b", "a100-sxm4-80gb", 2, "trtllm"),
])
def test_iteration_time_equals_infer_phases(name, gpu, tp, runtime):
    """A prefill-only iteration of b prompts is infer's TTFT; a decode-only iteration at the
    mean context is infer's TPOT (both from the same operations)."""
    m, sy = presets.model(name), presets.system(gpu)
    rt = presets.runtime(runtime) if runtime else None
    for b, s, o in [(1, 467, 256), (8, 1000, 100), (64, 128, 128)]:
        plan = InferencePlan(tp=tp, batch=b, input_len=s, output_len=o)
        r = infer(m, sy, plan, None, rt)
        cost = iteration_cost(m, sy, plan, max(8192.0, b * s), None, rt)
        prefill = iteration_time(cost, b * s, b, 0.0, b * 0.5 * s * s, 1.0)
        context = float(m.mean_cached_tokens(s, s + o))
        decode = iteration_time(cost, b, b, b * context, 0.0, 0.0)
        # equal up to the pass's interpolation between grid token counts (<= 0.5 %)
        assert float(prefill) == pytest.approx(float(r.ttft), rel=5e-3)
        assert float(decode) == pytest.approx(float(r.tpot), rel=5e-3)


def test_context_pass_first_token_by_hand():
    """`Engine.context_pass` (TurboMind v0.1): one request of s prompt tokens waits for a
    context pass over s - 1 tokens, then a decode pass of one token reading s keys; a
    one-token prompt skips the context pass. By hand from `iteration_time`, on a real cost;
    the mixed engine (one pass of s tokens) is faster, by about one decode pass at s = 128
    where both passes are weight-bound (LMDeploy's A100 table: 22 ms against 11 ms for a
    one-token prompt, Llama-2-7B)."""
    m, sy = presets.model("llama2-7b"), presets.system("a100-sxm4-80gb")
    plan = InferencePlan(tp=1, input_len=128, output_len=4)
    cost = iteration_cost(m, sy, plan, 4096.0)
    for s in (1, 128, 2048):
        ttft = {}
        for two in (0, 1):
            engine = Engine(max_num_seqs=4, max_num_batched_tokens=4096, chunked_prefill=0,
                            context_pass=two)
            req = Requests(jnp.zeros(1), jnp.full(1, float(s)), jnp.full(1, 4.0))
            got = simulate(cost, engine, 1e6, req, 4, 64)
            ttft[two] = float(got.ttft[0])
        ctx = (float(iteration_time(cost, s - 1, 0, 0.0, 0.5 * s * s, 1.0)) if s > 1 else 0.0)
        dec = float(iteration_time(cost, 1, 1, float(s), 0.0, 0.0))
        assert ttft[1] == pytest.approx(ctx + dec, rel=1e-5)
        mixed = float(iteration_time(cost, s, 1, 0.0, 0.5 * s * s, 1.0))
        assert ttft[0] == pytest.approx(mixed, rel=1e-5)
        if s == 1:  # no context pass: one decode pass, not slower than a prefill iteration
            assert ttft[1] <= ttft[0]
        elif s == 128:  # both passes weight-bound: the context pass costs about a decode pass
            assert 0.7 * dec < ttft[1] - ttft[0] < 1.3 * dec
        else:  # compute-bound prompt: the extra decode pass is a small share
            assert 0.0 < ttft[1] - ttft[0] < 0.15 * ttft[0]


def test_interpolated_pass_within_half_a_percent_of_exact():
    """The pass cost between grid points (linear interpolation) against the exact operation
    model at token counts off the grid."""
    m, sy = presets.model("llama3-70b"), presets.system("h100-sxm5-80gb")
    plan = InferencePlan(tp=4, input_len=512, output_len=128)
    cost = iteration_cost(m, sy, plan, 8192.0)
    for n in [3.0, 37.0, 129.0, 700.0, 3001.0, 7777.0]:
        exact = iteration_cost(m, sy, plan, n)  # n is the grid's last point there
        lerp = iteration_time(cost, n, n, 0.0, 0.0, 0.0)
        want = iteration_time(exact, n, n, 0.0, 0.0, 0.0)
        assert float(lerp) == pytest.approx(float(want), rel=5e-3)


def test_latencies_stay_exact_over_hours():
    """2,000 requests at 0.1 req/s span 5.5 hours, where a float32 clock has 2 ms steps: the
    simulation's TTFT and end-to-end latency (clock kept as a float32 pair, events measured
    from each arrival) equal the float64 reference to 1 us, and so does the iteration count."""
    from diffperf.serving import split_times
    rng = np.random.default_rng(3)
    n = 2000
    gaps = rng.exponential(10.0, n)
    arrival = np.cumsum(gaps) - gaps[0]
    assert arrival[-1] > 16384
    inp, out = rng.integers(100, 400, n), rng.integers(2, 60, n)
    engine = Engine(max_num_seqs=16, max_num_batched_tokens=512, block_size=16)
    ref = reference_schedule(arrival, inp, out, max_num_seqs=16, max_num_batched_tokens=512,
                             chunked_prefill=1, policy=0, kv_capacity=1e9, block_size=16,
                             iteration_time=_affine)
    import diffperf.serving._simulate as sim
    original = sim._base, sim._with_keys, sim.keys_read
    sim._base = lambda cost, *a: a
    sim._with_keys = lambda cost, base, keys: _affine(base[0], base[1], keys, base[3], base[4])
    sim.keys_read = lambda cost, ctx: ctx
    try:
        hi, lo = split_times(arrival)
        req = Requests(jnp.asarray(hi), jnp.asarray(inp, jnp.float32),
                       jnp.asarray(out, jnp.float32), jnp.asarray(lo))
        got = simulate(None, engine, 1e9, req, 16, step_bound(inp, engine))
    finally:
        sim._base, sim._with_keys, sim.keys_read = original
    np.testing.assert_allclose(np.asarray(got.ttft, float), ref.ttft, atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(got.e2e, float), ref.e2e, atol=1e-6, rtol=0)
    assert float(got.iterations) == len(ref.iterations)


def test_per_sequence_host_work_runs_beside_the_gpu():
    """`Runtime.host_seq_time`: a decode iteration of n sequences takes max(GPU, n t_seq)
    (smoothly): hidden at 1 us per sequence, the host's n t_seq at 1 ms; more never faster;
    the static model (`infer`) charges the same."""
    import equinox as eqx

    from diffperf.specs import Runtime

    m, sy = presets.model("llama3-8b"), presets.system("h100-sxm5-80gb")
    plan = InferencePlan(tp=1, input_len=256.0, output_len=64.0)
    times = []
    for t in (0.0, 1e-6, 1e-3, 2e-3):
        rt = eqx.tree_at(lambda r: r.host_seq_time, Runtime(), t)
        cost = iteration_cost(m, sy, plan, 1024.0, None, rt)
        times.append(float(iteration_time(cost, 128.0, 128.0, 128.0 * 300.0, 0.0, 0.0)))
    gpu = times[0]
    assert gpu < 0.128
    assert times[1] == pytest.approx(gpu, rel=1e-3)
    # host-bound: at least the host's 128 x 1 ms, at most that plus the GPU step (the smooth
    # overlap of `exposed_after_overlap` adds a little near the knee)
    assert 0.128 <= times[2] <= 0.128 + gpu
    assert times == sorted(times)
    # the same per-sequence host time in the static model: a decode iteration of b
    # sequences at the mean context is infer's TPOT with that runtime
    rt = eqx.tree_at(lambda r: r.host_seq_time, Runtime(), 2e-4)
    for b in (8, 256):
        bplan = InferencePlan(tp=1, batch=b, input_len=256.0, output_len=64.0)
        r = infer(m, sy, bplan, None, rt)
        cost = iteration_cost(m, sy, bplan, 8192.0, None, rt)
        context = float(m.mean_cached_tokens(256.0, 320.0))
        decode = iteration_time(cost, b, b, b * context, 0.0, 0.0)
        assert float(decode) == pytest.approx(float(r.tpot), rel=5e-3)


def test_a_slower_host_cpu_scales_the_host_stream_only():
    """`Accelerator.host_time_factor` f multiplies every host time of the serving runtime:
    host-bound (128 sequences at 1 ms each) a decode iteration takes f x 0.128 s up to the GPU
    step; GPU-bound (1 us each) it is unchanged; a larger f is never faster; the static model
    (`infer`) charges the same, with gradients against finite differences. The Grace presets
    carry 2.75 (TransformerEngine issue 2053), the x86 ones 1."""
    import equinox as eqx

    from diffperf.costs._roofline import SHARPNESS
    from diffperf.specs import Runtime

    assert float(presets.gpu("gb200").host_time_factor) == 2.75
    assert float(presets.gpu("gb300").host_time_factor) == 2.75
    assert float(presets.gpu("b200").host_time_factor) == 1.0
    m, sy = presets.model("llama3-8b"), presets.system("h100-sxm5-80gb")
    plan = InferencePlan(tp=1, input_len=256.0, output_len=64.0)

    def step(t_seq, factor):
        rt = eqx.tree_at(lambda r: r.host_seq_time, Runtime(), t_seq)
        s = eqx.tree_at(lambda x: x.accelerator.host_time_factor, sy, factor)
        cost = iteration_cost(m, s, plan, 1024.0, None, rt)
        return float(iteration_time(cost, 128.0, 128.0, 128.0 * 300.0, 0.0, 0.0))

    gpu = step(0.0, 1.0)
    assert step(1e-6, 2.75) == pytest.approx(gpu, rel=1e-3)  # hidden behind the GPU
    bound = [step(1e-3, f) for f in (1.0, 2.0, 2.75, 4.0)]
    smooth = 1.0 + SHARPNESS**2 / 4.0  # the smooth overlap's excess over the host time
    host = 0.128 * float(presets.default_efficiency().host_overhead)  # calibrated host speed
    for f, t in zip((1.0, 2.0, 2.75, 4.0), bound):
        assert f * host <= t <= smooth * f * host + gpu
    assert bound == sorted(bound)
    # the static model: the same factor on infer's decode host stream
    rt = eqx.tree_at(lambda r: r.host_seq_time, Runtime(), 1e-3)
    bplan = InferencePlan(tp=1, batch=128, input_len=256.0, output_len=64.0)

    def tpot(factor):
        s = eqx.tree_at(lambda x: x.accelerator.host_time_factor, sy, factor)
        return infer(m, s, bplan, None, rt).tpot

    assert 2.75 * host <= float(tpot(2.75)) <= smooth * 2.75 * host + gpu
    f0, h = jnp.asarray(2.0), 1e-3
    fd = (float(tpot(f0 + h)) - float(tpot(f0 - h))) / (2 * h)
    assert float(jax.grad(tpot)(f0)) == pytest.approx(fd, rel=2e-2)


@pytest.mark.parametrize("field,value,tp", [
    ("host_op_time", 1e-3, 1),          # H = L x 40 operators x 1 ms, far beyond the GPU step
    ("host_collective_time", 5e-3, 2),  # H = L x 2 all-reduces x 5 ms at TP 2
    ("host_step_time", 0.1, 1),         # added to the step as it is
])
def test_host_time_factor_scales_every_serving_host_time(field, value, tp):
    """Each runtime host time, made to dominate a decode iteration, costs f times as much with
    `host_time_factor` f: the iteration minus its GPU-only time grows by f within the smooth
    overlap's excess (the issue stream) or exactly (the step time)."""
    import equinox as eqx

    from diffperf.costs._roofline import SHARPNESS
    from diffperf.specs import Runtime

    m, sy = presets.model("llama3-8b"), presets.system("h100-sxm5-80gb")
    plan = InferencePlan(tp=tp, input_len=256.0, output_len=64.0)
    rt = eqx.tree_at(lambda r: getattr(r, field), Runtime(), value)
    s_fit = float(presets.default_efficiency().host_overhead)  # the calibrated host speed
    host = s_fit * {"host_op_time": 32 * 40 * value, "host_collective_time": 32 * 2 * value,
                    "host_step_time": value}[field]  # per iteration at factor 1, s

    def step(runtime, factor):
        s = eqx.tree_at(lambda x: x.accelerator.host_time_factor, sy, factor)
        cost = iteration_cost(m, s, plan, 1024.0, None, runtime)
        return float(iteration_time(cost, 8.0, 8.0, 8.0 * 300.0, 0.0, 0.0))

    gpu = step(Runtime(), 1.0)
    smooth = 1.0 + SHARPNESS**2 / 4.0
    for f in (1.0, 2.75):
        t = step(rt, f)
        if field == "host_step_time":
            assert t == pytest.approx(gpu + f * host, rel=1e-4)
        else:
            assert f * host <= t <= smooth * f * host + gpu


def test_kv_cache_tokens_set_directly_or_refused():
    """`Engine.kv_cache_tokens`: the replica's cache as set when it fits beside the weights
    (Llama-3-8B bf16, 128 KiB per token: 100,000 tokens = 13 GB beside 16 GB of weights on an
    80-GB GPU), 0 (nothing admitted, a search drops the deployment) when it does not (1e6
    tokens = 131 GB), and from kv_memory_fraction when unset."""
    from diffperf import default_efficiency
    from diffperf.serving._capacity import replica_kv_tokens
    m, sy = presets.model("llama3-8b"), presets.system("h100-sxm5-80gb")
    plan = InferencePlan(tp=1, input_len=512, output_len=128)
    eff = default_efficiency("h100-sxm5-80gb")
    kv = lambda **f: float(replica_kv_tokens(m, sy, plan, Engine(**f), eff))  # noqa: E731
    assert kv(kv_cache_tokens=100_000) == 100_000
    assert kv(kv_cache_tokens=1_000_000) == 0.0
    assert 300_000 < kv() < 600_000  # 0.9 of what is left after weights and activations
