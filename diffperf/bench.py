"""`diffperf bench`: evaluations per second of vmapped sweeps, single-call latency after jit,
and the cost of a reverse-mode gradient relative to a forward evaluation."""

from __future__ import annotations

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .plans import TrainingPlan
from .presets import default_efficiency, model, system
from .training import train_step

#: Configurations per compiled call: large enough to amortise dispatch, small enough that the
#: intermediates stay in cache (measured fastest on a 2-core CPU).
CHUNK = 65536


def random_plans(n: int, gpus: int = 1024, global_batch: int = 1536, seed: int = 0):
    """`n` random plans for `gpus` GPUs as one batched TrainingPlan (tp*pp*dp = gpus)."""
    rng = np.random.default_rng(seed)
    tp = rng.choice([1, 2, 4, 8], n)
    pp = rng.choice([1, 2, 4, 8, 16, 32], n)
    return TrainingPlan(
        tp=tp, pp=pp, dp=gpus / (tp * pp), cp=np.ones(n), ep=np.ones(n),
        micro_batch=rng.choice([1, 2, 4, 8], n), global_batch=np.full(n, global_batch),
        vp=rng.choice([1, 2, 3, 4], n), sequence_parallel=rng.integers(0, 2, n),
        recompute=rng.integers(0, 3, n), zero=rng.integers(0, 4, n),
        precision=np.ones(n), flash_attention=rng.integers(0, 2, n),
        overlap_tp=np.ones(n), overlap_dp=np.ones(n))


def _slice(tree, i, j):
    return jax.tree.map(lambda x: x[i:j], tree)


def sweep_rate(n: int = 1_000_000, repeats: int = 3) -> dict:
    """Training evaluations per second of GPT-3 175B on 1,024 A100s over `n` random plans."""
    m, s, e = model("gpt3-175b"), system("a100-sxm4-80gb"), default_efficiency()

    @jax.jit
    @jax.vmap
    def evaluate(plan):
        r = train_step(m, s, plan, e)
        return r.step_time, r.memory.total, r.mfu, r.feasible

    plans = random_plans(n)
    chunks = [_slice(plans, i, min(i + CHUNK, n)) for i in range(0, n, CHUNK)]
    pad = jax.tree.map(lambda x: jnp.asarray(x), chunks[-1])
    jax.block_until_ready(evaluate(chunks[0]))
    if len(chunks) > 1:
        jax.block_until_ready(evaluate(pad))
    best, feasible = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [evaluate(c) for c in chunks]
        jax.block_until_ready(outs)
        best = min(best, time.perf_counter() - t0)
        feasible = int(sum(int(o[3].sum()) for o in outs))
    return {"configs": n, "seconds": best, "evals_per_s": n / best, "feasible": feasible}


def _timeit(f, *args, number: int = 200) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(number):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / number)
    return min(times)


def gradient_cost() -> dict:
    """Seconds per forward and per reverse-mode gradient of step time w.r.t. every leaf of the
    System and Efficiency pytrees: one configuration (latency after jit) and a batch of 4,096."""
    m, s, e = model("gpt3-175b"), system("a100-sxm4-80gb"), default_efficiency()
    plan = TrainingPlan(tp=8, pp=8, dp=16, micro_batch=1, global_batch=1536, vp=3,
                        sequence_parallel=1, recompute="selective")

    def step(sys_, eff, p):
        return train_step(m, sys_, p, eff).step_time

    fwd = jax.jit(step)
    grad = jax.jit(jax.grad(step, argnums=(0, 1)))
    single_fwd = _timeit(fwd, s, e, plan)
    single_grad = _timeit(grad, s, e, plan)
    n_leaves = len(jax.tree.leaves((s, e)))

    batch = _slice(random_plans(4096, seed=1), 0, 4096)
    bfwd = jax.jit(jax.vmap(step, in_axes=(None, None, 0)))
    bgrad = jax.jit(jax.vmap(jax.grad(step, argnums=(0, 1)), in_axes=(None, None, 0)))
    batch_fwd = _timeit(bfwd, s, e, batch, number=20)
    batch_grad = _timeit(bgrad, s, e, batch, number=20)
    return {"parameters": n_leaves, "single_forward_s": single_fwd, "single_grad_s": single_grad,
            "single_ratio": single_grad / single_fwd, "batch": 4096,
            "batch_forward_s": batch_fwd, "batch_grad_s": batch_grad,
            "batch_ratio": batch_grad / batch_fwd}


def run_all(n: int = 1_000_000, log=print) -> dict:
    """Run every benchmark; print a readable summary through `log` (None = silent)."""
    say = log or (lambda *a: None)
    say(f"jax {jax.__version__} on {jax.device_count()} {jax.devices()[0].platform} device(s)")
    sweep = sweep_rate(n)
    say(f"training sweep: {sweep['configs']:,} random plans (GPT-3 175B, 1,024 A100) in "
        f"{sweep['seconds']:.3f} s = {sweep['evals_per_s'] / 1e6:.2f} M evaluations/s "
        f"({sweep['feasible']:,} feasible)")
    g = gradient_cost()
    say(f"single configuration after jit: forward {g['single_forward_s'] * 1e6:.0f} us, "
        f"gradient w.r.t. {g['parameters']} hardware + efficiency parameters "
        f"{g['single_grad_s'] * 1e6:.0f} us (ratio {g['single_ratio']:.2f})")
    say(f"batch of {g['batch']}: forward {g['batch_forward_s'] * 1e3:.2f} ms, gradient "
        f"{g['batch_grad_s'] * 1e3:.2f} ms (ratio {g['batch_ratio']:.2f})")
    result = {"sweep": sweep, "gradient": g}
    try:
        from ._cli_infer import bench_inference
    except ImportError:
        bench_inference = None
    if bench_inference is not None:
        inf = bench_inference(n=min(n, 262144))
        result["inference"] = inf
        rate = inf["evals_per_s"] if isinstance(inf, dict) else float(inf)
        say(f"inference sweep: {rate / 1e6:.2f} M evaluations/s")
    return result
