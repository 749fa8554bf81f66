"""Multi-host sweeps (`jax.distributed`) that cannot be silently wrong: the processes agree on
one block size whatever memory each has free, refuse to merge different sweeps, break every tie
by the global flat index (so any process count gives the one-process answer), and the CLI
joins a job from options, DIFFPERF_* or Slurm variables, with only process 0 reporting.

The two-process tests start real processes on 127.0.0.1 (CPU, Gloo collectives); the fast
ones simulate the processes' shares in one process (`_local_reductions` + `_merge`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from diffperf.cli._checks import CliError
from diffperf.cli._distributed import DEFAULT_PORT, first_host, resolve_distributed
from diffperf.explore import Grid, run_sweep
from diffperf.explore._sweep import (
    FREE_MEMORY_ENV,
    _Blocks,
    _local_reductions,
    _merge,
    agreed_block_limit,
    block_limit,
)


def _ties(v):
    """Every point ties exactly at objective 1 except the first block (a == 0, worse), in two
    Pareto bins (b even / odd); a few are infeasible. The lowest feasible flat index in each
    bin lies in block 1, which a second process holds: the process number must not decide."""
    obj = jnp.where(v["a"] == 0, 2.0, 1.0) + 0.0 * v["b"]
    sec = 1e9 * (1.0 + 9.0 * jnp.mod(v["b"], 2.0))
    reason = jnp.where(jnp.mod(v["a"] + v["b"], 7.0) == 0, 3, 0).astype(jnp.int32)
    return obj, sec, reason


TIES_GRID = {"a": list(range(12)), "b": list(range(50))}


def _summary(res) -> dict:
    return {"feasible": res.feasible, "top": res.top_index.tolist(),
            "top_value": res.top_value.tolist(), "reasons": res.reasons.tolist(),
            "front": res.front_index.tolist(), "front_value": res.front_value.tolist(),
            "front_secondary": res.front_secondary.tolist()}


def test_simulated_processes_merge_ties_by_flat_index():
    """Split the blocks over 2 and 3 simulated processes and merge: the same result as one
    process, ties to the lowest flat index (50 and 51, in process 1's block), where taking
    the lowest process's candidate (the old `argmin` merge) gave 100 and 101 (150, 151 for
    three processes)."""
    import jax
    grid = Grid(TIES_GRID)
    one = run_sweep(grid, _ties, k=5, progress=False, max_block=50)
    assert one.top_index.tolist() == [50, 51, 52, 53, 54]
    assert sorted(one.front_index[one.front_index >= 0].tolist()) == [50, 51]
    blocks = _Blocks(grid, jax.local_devices(), 50)
    for count in (2, 3):
        parts = [_local_reductions(grid, _ties, blocks, 5, (1e9, 1e12), 32, i, count)
                 for i in range(count)]
        stacked = tuple(np.stack(x) for x in zip(*parts))
        top_v, top_i, hist, fv, fi, fs, nfeas = _merge(stacked, 5)
        assert top_i.tolist() == one.top_index.tolist()
        assert fi.tolist() == one.front_index.tolist()
        assert fs.tolist() == one.front_secondary.tolist()
        assert hist.tolist() == one.reasons.tolist() and int(nfeas) == one.feasible
        old = stacked[4][np.argmin(stacked[3], axis=0), np.arange(fv.size)]
        # the bug this pins down: process 0's best (block `count`) won every tie
        assert sorted(old[old >= 0].tolist()) == [50 * count, 50 * count + 1]


def test_merge_pads_unfilled_top_entries_with_minus_one():
    """Fewer feasible points than k: the padding is (inf, -1) whatever the process count
    (a real index of an infeasible point used to fill it, differently per process)."""
    grid = Grid({"a": list(range(8))})
    res = run_sweep(grid, lambda v: (v["a"], 1e9 + 0.0 * v["a"],
                                     jnp.where(v["a"] < 2, 0, 1).astype(jnp.int32)),
                    k=5, progress=False)
    assert res.top_index.tolist() == [0, 1, -1, -1, -1]
    assert np.isinf(res.top_value[2:]).all()


def test_block_limit_memory_hook(monkeypatch):
    """`DIFFPERF_FREE_HOST_MEMORY` (the test hook / override) decides `block_limit`; a small
    `max_block` is kept even below the 1024-per-device floor of the memory cap."""
    monkeypatch.setenv(FREE_MEMORY_ENV, "64e6")
    assert block_limit(1) == 64_000_000 // 4 // 4096
    monkeypatch.setenv(FREE_MEMORY_ENV, "1")
    assert block_limit(2) == 2048
    assert block_limit(1, max_block=64) == 64
    assert agreed_block_limit(1) == block_limit(1)  # one process: its own
    monkeypatch.setenv(FREE_MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match=FREE_MEMORY_ENV):
        block_limit(1)


@pytest.mark.parametrize("nodes, host", [
    ("node[01-04],gpu7", "node01"), ("gpu7", "gpu7"), ("gpu7,gpu8", "gpu7"),
    ("node[1,3-5]", "node1"), ("rack[2-3]-n[07,09],x1", "rack2-n07"),
    ("a[005-007,010]b", "a005b")])
def test_first_host_of_a_slurm_nodelist(nodes, host):
    assert first_host(nodes) == host


def _args(**kw):
    base = {"coordinator": None, "coordinator_port": None, "num_processes": None,
            "process_id": None}
    return SimpleNamespace(**(base | kw))


def test_resolve_from_options_environment_and_slurm():
    c = resolve_distributed(_args(coordinator="10.0.0.1:1234", num_processes=4, process_id=3),
                            {})
    assert (c.coordinator, c.num_processes, c.process_id) == ("10.0.0.1:1234", 4, 3)
    env = {"DIFFPERF_COORDINATOR": "h0", "DIFFPERF_NUM_PROCESSES": "2",
           "DIFFPERF_PROCESS_ID": "1", "DIFFPERF_COORDINATOR_PORT": "999",
           "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_STEP_NODELIST": "n[3-4]"}
    c = resolve_distributed(_args(), env)
    assert (c.coordinator, c.num_processes, c.process_id) == ("h0:999", 2, 1)
    c = resolve_distributed(_args(process_id=0), env)  # the option wins
    assert c.process_id == 0 and "--process-id" in c.sources
    slurm = {k: v for k, v in env.items() if k.startswith("SLURM")}
    c = resolve_distributed(_args(), slurm)
    assert (c.coordinator, c.num_processes, c.process_id) == (f"n3:{DEFAULT_PORT}", 8, 5)
    c = resolve_distributed(_args(coordinator_port=7000),
                            {"SLURM_NTASKS": "2", "SLURM_PROCID": "0",
                             "SLURM_JOB_NODELIST": "gpu[10-11]"})
    assert c.coordinator == "gpu10:7000"


@pytest.mark.parametrize("kw, env, text", [
    ({}, {}, "--distributed needs --coordinator HOST:PORT"),
    ({"coordinator": "h:1"}, {}, "--num-processes N"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, {}, "must be in 0 .. 1"),
    ({"coordinator": "h:1", "num_processes": 0, "process_id": 0}, {}, "must be >= 1"),
    ({"coordinator": "h:x", "num_processes": 2, "process_id": 0}, {}, "port .* integer"),
    ({"coordinator": ":5", "num_processes": 2, "process_id": 0}, {}, "has no host"),
    ({"coordinator": "h:70000", "num_processes": 2, "process_id": 0}, {}, "1 .. 65535"),
    ({}, {"DIFFPERF_COORDINATOR": "h:1", "SLURM_NTASKS": "two", "SLURM_PROCID": "0"},
     r"SLURM_NTASKS.*integer"),
])
def test_resolve_refuses_incomplete_or_inconsistent_settings(kw, env, text):
    with pytest.raises(CliError, match=text) as e:
        resolve_distributed(_args(**kw), env)
    assert "\n" not in str(e.value)


def test_cli_distributed_errors_are_one_line(capsys, monkeypatch):
    from diffperf.cli import main
    for name in list(os.environ):
        if name.startswith(("SLURM_", "DIFFPERF_COORDINATOR", "DIFFPERF_NUM_PROCESSES",
                            "DIFFPERF_PROCESS_ID")):
            monkeypatch.delenv(name)
    assert main(["search", "train", "--distributed", "--num-processes", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --distributed needs --coordinator") and "\n" not in err
    assert main(["search", "infer", "--coordinator", "h:1"]) == 2
    assert "--coordinator given without --distributed" in capsys.readouterr().err


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k != "XLA_FLAGS" and not k.startswith(("SLURM_", "DIFFPERF_COORDINATOR",
                                                     "DIFFPERF_NUM_PROCESSES",
                                                     "DIFFPERF_PROCESS_ID", FREE_MEMORY_ENV))}
    return env | {"JAX_PLATFORMS": "cpu"} | extra


def _run_pair(commands, envs, timeout=300):
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for cmd, env in zip(commands, envs)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


_TRAINING = r"""
import diffperf as dp
from diffperf.explore import plan_from_values
m, s, e = dp.model("gpt-7.5b"), dp.system("a100-sxm4-40gb"), dp.Efficiency()
GRID = {"tp": [1, 2, 4, 8], "pp": [1, 2, 4], "micro_batch": [1, 2, 4],
        "recompute": [0, 1, 2], "zero": [0, 1, 3], "vp": [1, 2], "flash_attention": [0, 1]}
def train(v):
    r = dp.train_step(m, s, plan_from_values(v, 32, 64), e)
    return r.step_time, r.memory.total, r.reason
"""

_WORKER = r"""
import json, sys
import jax
pid, port = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid)
from diffperf.explore import Grid, run_sweep
from diffperf.explore._sweep import SweepMismatchError, agreed_block_limit
from test_multihost import TIES_GRID, _TRAINING, _summary, _ties
exec(_TRAINING)
out = {"procs": jax.process_count(), "block": agreed_block_limit()}
# (a) unequal free memory: process 1 runs with DIFFPERF_FREE_HOST_MEMORY=1 (1024-point blocks)
out["training"] = _summary(run_sweep(Grid(GRID), train, k=6, progress=False))
# (b) exact ties, blocks of 50: the lowest flat index in each bin is in process 1's block
out["ties"] = _summary(run_sweep(Grid(TIES_GRID), _ties, k=5, progress=False, max_block=50))
# (c) different grids: both processes refuse to merge
try:
    run_sweep(Grid({"a": list(range(12 + pid)), "b": list(range(50))}), _ties, k=5,
              progress=False, max_block=50)
    out["mismatch"] = None
except SweepMismatchError as e:
    out["mismatch"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_two_processes_equal_one_with_unequal_memory_ties_and_mismatch():
    """Two jax.distributed processes on 127.0.0.1, process 1 short of memory: the same
    feasible count, top plans and Pareto front as one process for a training grid and for a
    grid of exact ties; two different grids are refused on both processes."""
    port = _free_port()
    here = os.path.dirname(__file__)
    envs = [_env(PYTHONPATH=here), _env(PYTHONPATH=here, **{FREE_MEMORY_ENV: "1"})]
    results = _run_pair([[sys.executable, "-c", _WORKER, str(i), port] for i in range(2)],
                        envs)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    outs = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
    assert outs[0]["procs"] == 2 and outs[0]["block"] == 1024  # the smaller of the two
    for key in ("training", "ties"):
        assert outs[0][key] == outs[1][key]
    ns: dict = {}
    exec(_TRAINING, ns)
    ref = _summary(run_sweep(Grid(ns["GRID"]), ns["train"], k=6, progress=False))
    assert outs[0]["training"] == ref
    assert ref["feasible"] > 0
    ties = _summary(run_sweep(Grid(TIES_GRID), _ties, k=5, progress=False, max_block=50))
    assert outs[0]["ties"] == ties
    assert ties["top"] == [50, 51, 52, 53, 54]
    for out in outs:
        assert "disagree" in out["mismatch"] and "600 points" in out["mismatch"]


@pytest.mark.slow
def test_cli_search_train_distributed_equals_one_process(tmp_path, capsys):
    """`diffperf search train ... --distributed` on two local processes (process 0 from the
    options, process 1 from DIFFPERF_* variables) prints the one-process answer on process 0
    only; process 1 prints nothing on stdout and writes no file."""
    from diffperf.cli import main
    search = ["search", "train", "--model", "gpt-1.7b", "--gpus", "8", "--global-batch", "32",
              "--precision", "bf16", "--top", "5", "--json"]
    port = _free_port()
    cli = [sys.executable, "-m", "diffperf.cli"]
    out0, out1 = tmp_path / "p0.csv", tmp_path / "p1.csv"
    results = _run_pair(
        [cli + search + ["--out", str(out0), "--distributed", "--coordinator",
                         f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0"],
         cli + search + ["--out", str(out1), "--distributed"]],
        [_env(), _env(DIFFPERF_COORDINATOR=f"127.0.0.1:{port}", DIFFPERF_NUM_PROCESSES="2",
                      DIFFPERF_PROCESS_ID="1")])
    for code, _, err in results:
        assert code == 0, err[-3000:]
    (_, stdout0, _), (_, stdout1, err1) = results
    assert stdout1 == "" and "process 0 prints the report" in err1
    assert out0.exists() and not out1.exists()
    two = json.loads(stdout0)  # nothing but the report on stdout (no Gloo lines)
    assert main(search) == 0
    one = json.loads(capsys.readouterr().out)
    for key in ("evaluated", "feasible", "infeasible_by_reason", "top",
                "pareto_memory_vs_time"):
        assert two[key] == one[key], key
