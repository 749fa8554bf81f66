"""`--distributed`: join a multi-host (`jax.distributed`) job from the command line.

Each setting comes from, in this order: the command-line option, a `DIFFPERF_*` environment
variable, Slurm's variables (inside `srun`), or a default:

- coordinator `HOST[:PORT]`: `--coordinator`, `DIFFPERF_COORDINATOR`, else the first host of
  `SLURM_STEP_NODELIST` (or `SLURM_JOB_NODELIST`); its port, when the address has none:
  `--coordinator-port`, `DIFFPERF_COORDINATOR_PORT`, else `DEFAULT_PORT`;
- number of processes: `--num-processes`, `DIFFPERF_NUM_PROCESSES`, `SLURM_NTASKS`;
- this process's id (0 .. N-1): `--process-id`, `DIFFPERF_PROCESS_ID`, `SLURM_PROCID`.

`jax.distributed.initialize` is then called with all three before any JAX computation, and
only process 0 prints the report and writes the output files. The processes must be started
with the same command otherwise (`run_sweep` checks the grid and blocks and refuses a
mismatch).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax

from ._all_plans import check_all_plans
from ._checks import CliError

#: The coordinator's port when neither the address nor --coordinator-port / the environment
#: names one.
DEFAULT_PORT = 61437
#: The environment variables read for each setting (after the command-line option).
ENV_COORDINATOR = "DIFFPERF_COORDINATOR"
ENV_PORT = "DIFFPERF_COORDINATOR_PORT"
ENV_NUM_PROCESSES = "DIFFPERF_NUM_PROCESSES"
ENV_PROCESS_ID = "DIFFPERF_PROCESS_ID"


@dataclass(frozen=True)
class DistributedConfig:
    """Where and who this process is in a multi-host job."""

    coordinator: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int
    sources: str  # where the settings came from, for messages


def add_distributed_arguments(parser) -> None:
    """The multi-host options of `search train|infer`."""
    g = parser.add_argument_group(
        "multi-host", "join a jax.distributed job: start the same command on every host "
                      "(docs/multihost.md); each option can also come from the environment")
    g.add_argument("--distributed", action="store_true",
                   help="split the search over the processes of a multi-host job; only "
                        "process 0 prints and writes files")
    g.add_argument("--coordinator", default=None, metavar="HOST[:PORT]",
                   help=f"process 0's address (default: ${ENV_COORDINATOR}, else the first "
                        "host of $SLURM_STEP_NODELIST / $SLURM_JOB_NODELIST)")
    g.add_argument("--coordinator-port", type=int, default=None, metavar="PORT",
                   help=f"its port when HOST has none (default: ${ENV_PORT}, else "
                        f"{DEFAULT_PORT})")
    g.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help=f"processes in the job (default: ${ENV_NUM_PROCESSES}, else "
                        "$SLURM_NTASKS)")
    g.add_argument("--process-id", type=int, default=None, metavar="I",
                   help=f"this process, 0 .. N-1 (default: ${ENV_PROCESS_ID}, else "
                        "$SLURM_PROCID)")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'node[01-04],gpu7' -> 'node01',
    'rack[2-3]-n[7,9]' -> 'rack2-n7', 'gpu7' -> 'gpu7'."""
    text = nodelist.strip()
    depth, end = 0, len(text)
    for j, ch in enumerate(text):  # the first item: up to the first comma outside brackets
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = j
            break
    item = text[:end]
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0].strip(), item)
    if not host or "[" in host or "]" in host:
        raise CliError(f"cannot read the first host of the Slurm node list {nodelist!r}")
    return host


def _integer(value, what: str) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise CliError(f"--distributed: {what} must be an integer, got {value!r}") from None


def resolve_distributed(args, environ: Mapping[str, str] | None = None) -> DistributedConfig:
    """The coordinator, process count and process id from `args`, then `environ` (default
    `os.environ`): DIFFPERF_* variables, then Slurm's. Raises `CliError` (one line) when one
    is missing or they are inconsistent."""
    env = os.environ if environ is None else environ
    sources = []

    def pick(option: str, value, variables: tuple[str, ...]):
        if value is not None:
            sources.append(option)
            return value, option
        for name in variables:
            if env.get(name, "").strip():
                sources.append(f"${name}")
                return env[name].strip(), f"${name}"
        return None, None

    n, n_from = pick("--num-processes", args.num_processes,
                     (ENV_NUM_PROCESSES, "SLURM_NTASKS"))
    pid, pid_from = pick("--process-id", args.process_id, (ENV_PROCESS_ID, "SLURM_PROCID"))
    coord, coord_from = pick("--coordinator", args.coordinator, (ENV_COORDINATOR,))
    if coord is None:
        nodes, nodes_from = pick("", None, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"))
        if nodes is not None:
            coord, coord_from = first_host(nodes), nodes_from
    missing = [what for what, value in (
        (f"--coordinator HOST:PORT (or ${ENV_COORDINATOR})", coord),
        (f"--num-processes N (or ${ENV_NUM_PROCESSES})", n),
        (f"--process-id I (or ${ENV_PROCESS_ID})", pid)) if value is None]
    if missing:
        raise CliError("--distributed needs " + ", ".join(missing)
                       + " (under Slurm, run it with srun: SLURM_* give all three)")
    n = _integer(n, f"the number of processes ({n_from})")
    pid = _integer(pid, f"the process id ({pid_from})")
    if n < 1:
        raise CliError(f"--distributed: the number of processes ({n_from}) must be >= 1, "
                       f"got {n}")
    if not 0 <= pid < n:
        raise CliError(f"--distributed: the process id ({pid_from}) must be in 0 .. {n - 1} "
                       f"for {n} processes ({n_from}), got {pid}")
    host, sep, port_text = str(coord).strip().rpartition(":")
    if not sep:  # no port in the address
        host = str(coord).strip()
        port_value, port_from = pick("--coordinator-port", args.coordinator_port, (ENV_PORT,))
        port = DEFAULT_PORT if port_value is None else _integer(port_value,
                                                                f"the port ({port_from})")
        port_from = port_from or "the default"
    else:
        port = _integer(port_text, f"the coordinator's port ({coord_from})")
        port_from = coord_from
    if not host:
        raise CliError(f"--distributed: the coordinator address ({coord_from}) has no host: "
                       f"{coord!r}")
    if not 0 < port < 65536:
        raise CliError(f"--distributed: the coordinator's port ({port_from}) must be in "
                       f"1 .. 65535, got {port}")
    return DistributedConfig(f"{host}:{port}", n, pid, ", ".join(s for s in sources if s))


def check_not_distributed_options(args) -> None:
    """The multi-host options are refused without --distributed (a typo would otherwise run
    a whole search alone, silently)."""
    given = [opt for opt, value in (("--coordinator", args.coordinator),
                                    ("--coordinator-port", args.coordinator_port),
                                    ("--num-processes", args.num_processes),
                                    ("--process-id", args.process_id)) if value is not None]
    if given:
        raise CliError(f"{', '.join(given)} given without --distributed")


def initialize(config: DistributedConfig) -> None:
    """`jax.distributed.initialize` with `config` (a job of one process needs none). Must run
    before any JAX computation of this process."""
    if config.num_processes == 1:
        return
    try:
        jax.distributed.initialize(coordinator_address=config.coordinator,
                                   num_processes=config.num_processes,
                                   process_id=config.process_id)
    except RuntimeError as e:  # e.g. JAX already used, or the coordinator unreachable
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CliError(f"--distributed: joining the job at {config.coordinator} as process "
                       f"{config.process_id} of {config.num_processes} failed: {first}"
                       ) from None


@contextlib.contextmanager
def _stdout(leader: bool):
    """Native (C++) writes to stdout, such as Gloo's "[Gloo] Rank 0 is connected ..." lines,
    go to stderr on process 0 and nowhere on the others, so that stdout carries process 0's
    report only (a --json report stays parseable). Python's own stdout goes to the real
    stdout on process 0 and nowhere on the others."""
    sys.stdout.flush()
    try:
        real = sys.stdout.fileno() == 1  # not under a capturing test harness
    except (AttributeError, OSError, ValueError):
        real = False
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(2 if leader else null, 1)
    try:
        if leader and not real:
            yield
            return
        target = os.fdopen(os.dup(saved) if leader else os.dup(null), "w")
        with target, contextlib.redirect_stdout(target):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def distributed(command: Callable[[object], int | None]) -> Callable[[object], int | None]:
    """Wrap a `search` command: with --distributed, join the job first; on every process but
    process 0, print nothing on stdout (one note on stderr) and write no files."""
    @functools.wraps(command)
    def run(args):
        if not getattr(args, "distributed", False):
            if hasattr(args, "coordinator"):
                check_not_distributed_options(args)
            return command(args)
        config = resolve_distributed(args)
        if getattr(args, "all_plans", None):  # refused before joining the job
            check_all_plans(args.all_plans, distributed=True)
        leader = config.process_id == 0
        if not leader:
            print(f"note: process {config.process_id} of {config.num_processes} "
                  f"(coordinator {config.coordinator}): process 0 prints the report and "
                  f"writes the files", file=sys.stderr)
            for name in ("out", "plot"):
                if getattr(args, name, None):
                    setattr(args, name, None)
        with _stdout(leader):
            initialize(config)
            return command(args)
    return run
