"""`diffperf bench`: evaluations per second of vmapped sweeps, single-call latency after jit,
and the cost of a reverse-mode gradient relative to a forward evaluation."""

from __future__ import annotations

import csv
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..explore._search_training import default_training_grid, search_training
from ..inference._iteration import iteration_cost, kv_capacity_tokens
from ..presets import default_efficiency, model, resolve_efficiency, system
from ..serving import Requests, Traffic, requests, simulate, step_bound
from ..specs import Engine, InferencePlan
from ..specs._training_plan import TrainingPlan
from ..training._step import train_step
from ..validation._data import read_benchmarks, train_specs
from ._common import BENCHMARKS
from ._infer import bench_inference

#: Configurations per compiled call: large enough to amortise dispatch, small enough that the
#: intermediates stay in cache (measured fastest on a 2-core CPU).
CHUNK = 65536


def random_plans(n: int, gpus: int = 1024, global_batch: int = 1536, seed: int = 0,
                 layers: int = 96, heads: int = 96):
    """`n` random structurally valid plans for `gpus` GPUs (tp*pp*dp = gpus, tp divides the
    heads, dp*micro_batch divides the global batch, pp*vp <= layers, interleaving only with a
    micro-batch count divisible by pp) as one batched TrainingPlan. Whether each fits in memory
    is left to the model."""
    rng = np.random.default_rng(seed)
    cols = {k: [] for k in ("tp", "pp", "mb", "vp")}
    have = 0
    while have < n:
        m = 2 * (n - have) + 1024
        tp = rng.choice([1, 2, 4, 8], m)
        pp = rng.choice([1, 2, 4, 8, 16, 32], m)
        mb = rng.choice([1, 2, 4, 8], m)
        vp = rng.choice([1, 2, 3, 4], m)
        dp = gpus / (tp * pp)
        micro = global_batch / (dp * mb)
        ok = ((heads % tp == 0) & (micro == np.round(micro)) & (micro >= 1) & (pp * vp <= layers)
              & ((vp == 1) | ((pp > 1) & (np.mod(micro, pp) == 0))))
        for k, v in (("tp", tp), ("pp", pp), ("mb", mb), ("vp", vp)):
            cols[k].append(v[ok])
        have += int(ok.sum())
    tp, pp, mb, vp = (np.concatenate(cols[k])[:n] for k in ("tp", "pp", "mb", "vp"))
    return TrainingPlan(
        tp=tp, pp=pp, dp=gpus / (tp * pp), cp=np.ones(n), ep=np.ones(n), micro_batch=mb,
        global_batch=np.full(n, global_batch), vp=vp, sequence_parallel=rng.integers(0, 2, n),
        recompute=rng.integers(0, 3, n), zero=rng.integers(0, 4, n), precision=np.ones(n),
        flash_attention=rng.integers(0, 2, n), overlap_tp=np.ones(n),
        overlap_tp_backward=np.ones(n), overlap_dp=np.ones(n), zero3_per_matrix=np.zeros(n),
        recompute_layers=np.zeros(n), offload_layers=np.zeros(n), fp32_gradients=np.ones(n),
        account_embedding_loss=np.zeros(n), fp32_optimizer_moments=np.ones(n),
        expert_tp=np.zeros(n), overlap_ep=np.zeros(n), fused_expert_gemm=np.zeros(n),
        offload_optimizer=np.zeros(n), offload_weights=np.zeros(n), recompute_norms=np.zeros(n),
        recompute_moe_act=np.zeros(n), recompute_mla_up=np.zeros(n), recompute_mlp=np.zeros(n))


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
    if n < 2:
        raise ValueError(f"n must be at least 2 (the sweeps are vmapped over a batch), got {n}")
    say = log or (lambda *a: None)
    say(f"jax {jax.__version__} on {jax.device_count()} {jax.devices()[0].platform} device(s)")
    sweep = sweep_rate(n)
    say(f"training sweep: {sweep['configs']:,} random valid plans (GPT-3 175B, 1,024 A100) in "
        f"{sweep['seconds']:.3f} s = {sweep['evals_per_s'] / 1e6:.2f} M evaluations/s "
        f"({sweep['feasible']:,} also fit in HBM)")
    progress = (lambda m: print(m, file=sys.stderr, flush=True)) if log else (lambda m: None)
    progress("timing the gradient (it compiles first) ...")
    g = gradient_cost()
    say(f"single configuration after jit: forward {g['single_forward_s'] * 1e6:.0f} us, "
        f"gradient w.r.t. {g['parameters']} hardware + efficiency parameters "
        f"{g['single_grad_s'] * 1e6:.0f} us (ratio {g['single_ratio']:.2f})")
    say(f"batch of {g['batch']}: forward {g['batch_forward_s'] * 1e3:.2f} ms, gradient "
        f"{g['batch_grad_s'] * 1e3:.2f} ms (ratio {g['batch_ratio']:.2f})")
    result = {"sweep": sweep, "gradient": g}
    progress("timing the inference sweeps ...")
    inf = bench_inference(n=min(n, 262144))
    mapped = bench_inference(n=min(n, 262144), share_constants=False)
    result["inference"] = inf
    result["inference_all_fields_mapped"] = mapped
    say(f"inference sweep: {inf / 1e6:.2f} M evaluations/s ({mapped / 1e6:.2f} with every "
        f"model field mapped, as when a batch mixes MLA and standard attention)")
    return result


# ----------------------------------------------------------------------------- sweep engine
_WORKER = r"""
import json, sys, time
import jax
import diffperf as dp
from diffperf import search_training
t0 = time.perf_counter()
m, s = dp.model("gpt3-175b"), dp.system("a100-sxm4-80gb")
r = search_training(m, s, 1024, 1536, progress=False)
print(json.dumps({"devices": jax.device_count(), "evaluated": r["evaluated"],
                  "feasible": r["feasible"], "seconds": r["seconds"],
                  "best_step_time_s": float(r["top"]["step_time_s"].iloc[0])}))
"""


def _run_worker(devices: int) -> dict:
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # cold: compilation included
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={devices}").strip()
    out = subprocess.run([sys.executable, "-c", _WORKER], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def sweep_scaling(devices=(1, 2, 4, 8), log=print) -> list[dict]:
    """The exhaustive GPT-3 175B / 1,024 A100 search with 1, 2, 4, 8 forced CPU devices (each in
    a fresh process, compilation included). On a 2-core CPU more devices cannot add compute;
    this measures the sharding overhead and shows the results are identical."""
    say = log or (lambda *a: None)
    rows = []
    for n in devices:
        r = _run_worker(n)
        rows.append(r)
        say(f"{n} device(s): {r['evaluated']:,} plans in {r['seconds']:.2f} s = "
            f"{r['evaluated'] / r['seconds'] / 1e6:.2f} M/s (best {r['best_step_time_s']:.3f} s)")
    return rows


# ----------------------------------------------------------------------------------- search
#: The Megatron runs of the IMEC validation set compared with the search (their plans are read
#: from the benchmark CSV, not restated here).
MEGATRON_IDS = ("imec-korthi-22b-selsp", "imec-korthi-175b-selsp", "imec-korthi-530b-selsp",
                "imec-korthi-1t-selsp", "imec-selene-310b", "imec-selene-530b", "imec-selene-1t")


def _plan_text(plan) -> str:
    v = {k: int(round(float(getattr(plan, k)))) for k in ("tp", "pp", "dp", "vp", "micro_batch",
                                                           "recompute")}
    return (f"tp{v['tp']} pp{v['pp']} dp{v['dp']} vp{v['vp']} mb{v['micro_batch']} "
            f"{['none', 'selective', 'full'][v['recompute']]}")


def megatron_comparison(log=print, data=None) -> list[dict]:
    """For each Megatron run of the validation set (`MEGATRON_IDS` in
    benchmarks_data/train_calibration.csv): the predicted step time of the plan Megatron used
    and of the best plan an exhaustive search finds (same GPUs, batch and 16-bit precision; the
    search may also pick flash attention, ZeRO, other TP / PP / VP)."""
    say = log or (lambda *a: None)
    by_id = {r.id: r for r in read_benchmarks(data or BENCHMARKS / "train_calibration.csv")}
    rows = []
    for rid in MEGATRON_IDS:
        m, s, plan = train_specs(by_id[rid])
        eff = resolve_efficiency(None, by_id[rid].values["gpu"])  # that GPU's fitted factors
        gpus, gbs = int(round(float(plan.num_gpus))), int(round(float(plan.global_batch)))
        theirs = train_step(m, s, plan, eff)
        grid = default_training_grid(m, gpus, gbs, precisions=(1,))
        r = search_training(m, s, gpus, gbs, grid=grid, efficiency=eff, top_k=1,
                            progress=False)
        best = r["top"].iloc[0]
        row = {"id": rid, "gpus": gpus, "global_batch": gbs,
               "megatron_plan": _plan_text(plan),
               "megatron_predicted_s": float(theirs.step_time),
               "megatron_feasible": bool(theirs.feasible),
               "best_plan": f"tp{best['tp']} pp{best['pp']} dp{best['dp']} vp{best['vp']} "
                            f"mb{best['micro_batch']} {best['recompute']} zero{best['zero']} "
                            f"sp{best['sequence_parallel']} flash{best['flash_attention']}",
               "best_predicted_s": float(best["step_time_s"]),
               "evaluated": r["evaluated"], "seconds": r["seconds"]}
        rows.append(row)
        say(f"{rid:24s} Megatron {row['megatron_plan']:38s} {row['megatron_predicted_s']:8.2f} s"
            f" | best {row['best_plan']:52s} {row['best_predicted_s']:8.2f} s "
            f"({r['evaluated']:,} plans, {r['seconds']:.1f} s)")
    return rows


def search_benchmark(log=print) -> dict:
    """The GPT-3 175B / 1,024 A100 / global batch 1,536 exhaustive search, then the Megatron
    comparison."""
    say = log or (lambda *a: None)
    r = _run_worker(1)
    say(f"GPT-3 175B on 1,024 A100s, global batch 1,536: {r['evaluated']:,} plans "
        f"({r['feasible']:,} feasible) searched in {r['seconds']:.2f} s, compilation included "
        f"(fresh process)")
    return {"gpt3_175b_1024_a100": r, "megatron": megatron_comparison(log=log)}


# ------------------------------------------------------------------------------- serving
def serving_benchmark(deployments: int = 10_000, num_requests: int = 1000, slots: int = 64,
                      chunk: int = 1000, log=print) -> dict:
    """Simulate `deployments` serving deployments of Llama 3 8B on H100 (tensor parallelism
    1-8, HBM bandwidth x0.5-2, `max_num_seqs` up to `slots`, token budgets 2,048-8,192) each
    under the same `num_requests` Poisson requests (20 requests/s, prompts 512 +- 100, outputs
    128 +- 30 tokens), vmapped `chunk` deployments per compiled call; wall time with
    compilation, and without it (the second pass)."""
    say = log or (lambda *a: None)
    m, sy = model("llama3-8b"), system("h100-sxm5-80gb")
    arrival, inp, out = requests(Traffic(rate=20.0, num_requests=num_requests, input_len=512,
                                         output_len=128, input_spread=100, output_spread=30,
                                         distribution="normal"))
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    req = Requests(f32(arrival), f32(inp), f32(out))
    rng = np.random.default_rng(0)
    tp = f32(rng.choice([1, 2, 4, 8], deployments))
    hbm = f32(rng.uniform(0.5, 2.0, deployments)) * sy.accelerator.hbm_bandwidth
    seqs = f32(rng.choice([s for s in (8, 16, 32, 64, 128, 256) if s <= slots], deployments))
    budget = f32(rng.choice([2048, 4096, 8192], deployments))
    bound = step_bound(inp, Engine(max_num_batched_tokens=2048))
    plan = InferencePlan(input_len=512, output_len=128)

    def one(tp, h, s, b):
        system_ = eqx.tree_at(lambda x: x.accelerator.hbm_bandwidth, sy, h)
        p = eqx.tree_at(lambda q: q.tp, plan, tp)
        eng = Engine(max_num_seqs=s, max_num_batched_tokens=b)
        sched = simulate(iteration_cost(m, system_, p, b), eng,
                         kv_capacity_tokens(m, system_, p, b, s, 0.9), req, slots, bound)
        return jnp.mean(sched.first_token - sched.arrival), sched.steps, sched.completed

    f = jax.jit(jax.vmap(one))
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        outs = [f(tp[i:i + chunk], hbm[i:i + chunk], seqs[i:i + chunk], budget[i:i + chunk])
                for i in range(0, deployments, chunk)]
        jax.block_until_ready(outs)
        times.append(time.perf_counter() - t0)
    steps = np.concatenate([np.asarray(o[1]) for o in outs])
    completed = float(np.mean(np.concatenate([np.asarray(o[2]) for o in outs])))
    say(f"serving: {deployments:,} deployments x {num_requests:,} requests ({slots} request "
        f"slots) simulated in {times[1]:.1f} s ({times[0]:.1f} s with compilation); "
        f"{steps.mean():.0f} simulation steps per deployment on average; "
        f"{100 * completed:.0f} % completed (target: 10^4 x 1,000 in <= 60 s)")
    return {"deployments": deployments, "requests": num_requests, "slots": slots,
            "seconds": times[1], "seconds_with_compilation": times[0],
            "mean_steps": float(steps.mean()), "completed": completed}


# ---------------------------------------------------------------------------- command line
#: `bench cli`'s commands, each run in a fresh process: the module a prediction imports, one
#: training and one inference prediction (their defaults) and `validate` on a few rows.
CLI_COMMANDS = {
    "import diffperf": ["-c", "import diffperf"],
    "train": ["-m", "diffperf.cli", "train"],
    "infer": ["-m", "diffperf.cli", "infer"],
    "validate (8 rows)": ["-m", "diffperf.cli", "validate", "--data", "{train}", "--data",
                          "{infer}"],
}
#: `bench cli`'s commands also timed through a running `diffperf daemon` (a fresh client each).
DAEMON_COMMANDS = ("train", "infer", "validate (8 rows)")
DAEMON_START = ["-m", "diffperf.cli", "daemon", "start"]
DAEMON_STOP = ["-m", "diffperf.cli", "daemon", "stop", "--all"]
#: Rows of each shipped calibration CSV that `bench cli` validates.
CLI_ROWS = 4


def _few_rows(source, target, rows: int = CLI_ROWS) -> str:
    """Copy the header and the first `rows` rows of benchmark CSV `source` to `target`."""
    with open(source, newline="", encoding="utf-8-sig") as fh:
        lines = [line for line in fh if line.strip() and not line.lstrip().startswith("#")]
    records = list(csv.reader(lines))[: rows + 1]
    with open(target, "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows(records)
    return str(target)


def _timed_run(args: list[str], env: dict, cwd: str | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds of `python ARGS` run in directory `cwd` (CPU: user + system of the
    process and its threads, steadier than the wall time on a shared machine)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                         cwd=cwd)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` exited with {out.returncode}: "
                           f"{out.stderr.strip()[-500:]}")
    return seconds, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def cli_benchmark(repeats: int = 5, against: str | None = None, log=print) -> dict:
    """Wall time of the commands in `CLI_COMMANDS`, each in a fresh Python process with a warm
    compilation cache (a temporary directory, filled by one untimed run of each command):
    median, min and max of `repeats` runs; and of the same commands answered by a
    `diffperf daemon` (`DAEMON_COMMANDS`: a fresh client process, the daemon started once in a
    private temporary directory and stopped at the end). With `against` (a source tree, e.g. a
    `git worktree` of another commit), its runs alternate with this installation's, in the same
    directories and caches of their own: the two sets of figures are comparable on a busy
    machine (a tree without the daemon has no daemon rows)."""
    say = log or (lambda *a: None)
    if against and not (Path(against) / "diffperf" / "__init__.py").is_file():
        raise ValueError(f"--against {against}: not a source tree (no diffperf/__init__.py)")
    trees = {"this": None} | ({"against": str(against)} if against else {})
    has_daemon = {name: any(k in CLI_COMMANDS for k in DAEMON_COMMANDS)
                  and (Path(tree or Path(__file__).resolve().parents[2])
                       / "diffperf" / "cli" / "_daemon.py").is_file()
                  for name, tree in trees.items()}
    with tempfile.TemporaryDirectory(prefix="diffperf-bench-cli-") as tmp:
        files = {"train": _few_rows(BENCHMARKS / "train_calibration.csv", f"{tmp}/train.csv"),
                 "infer": _few_rows(BENCHMARKS / "infer_calibration.csv", f"{tmp}/infer.csv")}
        envs, daemon_envs = {}, {}
        for name, tree in trees.items():
            env = dict(os.environ)
            env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the command line's own cache
            env["DIFFPERF_COMPILATION_CACHE"] = f"{tmp}/cache-{name}"
            if tree:
                env["PYTHONPATH"] = os.pathsep.join([tree, *filter(None, [env.get("PYTHONPATH")])])
            # A daemon of the caller's must not answer the fresh-process runs; the daemon runs
            # use one of their own, in a private directory.
            daemon_envs[name] = {**env, "XDG_RUNTIME_DIR": f"{tmp}/run-{name}"}
            daemon_envs[name].pop("DIFFPERF_DAEMON", None)
            os.makedirs(daemon_envs[name]["XDG_RUNTIME_DIR"], mode=0o700)
            envs[name] = {**env, "DIFFPERF_DAEMON": "0"}
        commands = {k: [a.format(**files) for a in v] for k, v in CLI_COMMANDS.items()}
        commands |= {f"{k} (daemon)": commands[k] for k in DAEMON_COMMANDS if k in commands}
        runs: dict[str, dict[str, list[tuple[float, float]]]] = {
            n: {k: [] for k in commands if has_daemon[n] or "(daemon)" not in k} for n in trees}

        def env_of(name: str, label: str) -> dict:
            return daemon_envs[name] if "(daemon)" in label else envs[name]

        # Run in the temporary directory: `python -m` / `-c` put the working directory first
        # on sys.path, and from a source checkout its `diffperf/` would shadow `against`.
        try:
            for name in trees:  # fill the caches, then start the daemons
                for label in runs[name]:
                    if "(daemon)" not in label:
                        _timed_run(commands[label], envs[name], tmp)
                if has_daemon[name]:
                    _timed_run(DAEMON_START, daemon_envs[name], tmp)
            for _ in range(repeats):
                for label, args in commands.items():
                    for name in trees:
                        if label in runs[name]:
                            runs[name][label].append(
                                _timed_run(args, env_of(name, label), tmp))
        finally:
            for name in trees:
                if has_daemon[name]:
                    subprocess.run([sys.executable, *DAEMON_STOP], env=daemon_envs[name],
                                   cwd=tmp, capture_output=True)
    result: dict = {"repeats": repeats, "rows_per_csv": CLI_ROWS, "against": against}
    for name in trees:
        result[name] = {}
        for label, r in runs[name].items():
            wall, cpu = [w for w, _ in r], [c for _, c in r]
            result[name][label] = {"median_s": float(np.median(wall)), "min_s": min(wall),
                                   "max_s": max(wall), "runs_s": wall,
                                   "cpu_median_s": float(np.median(cpu))}
    say(f"warm compilation cache; a fresh process per command, or a fresh client of a running "
        f"daemon (daemon); wall time median (min-max) of {repeats} runs, [CPU time median of "
        f"the command's process]" + (f"; alternating with {against}" if against else ""))
    for label in commands:
        cells = [(f"{r['median_s']:5.2f} s ({r['min_s']:.2f}-{r['max_s']:.2f}) "
                  f"[{r['cpu_median_s']:.2f}]") if r else "-"
                 for r in (result[n].get(label) for n in trees)]
        say(f"  {label:29s} " + ("   against: ".join(cells)))
    return result
