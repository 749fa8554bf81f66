"""Benchmark rows stacked for vmapped evaluation: the stacked specs of the rows of one kind
(built a chunk of rows at a time, not row by row), per-row efficiency factors, fixed-shape
chunks of rows for one compiled program, progress on stderr, the compiler options of a one-off
evaluation, and the message of a row whose plan does not fit in memory."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..feasibility import explain
from ..presets import DEFAULT_RUNTIME, resolve_efficiency, runtime
from ..specs._efficiency import Efficiency
from ._data import BenchmarkRow, row_system


def stack(trees):
    """Stack a list of pytrees with identical structure along a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def constants_static(tree):
    """A stacked `tree` with every leaf whose values are equal along the batch replaced by that
    one value as a Python float. `eqx.filter_vmap` broadcasts such leaves instead of mapping
    them, and the model sees them concrete: trace-time specialisation
    (`Transformer.known_absent` / `known_present`) and XLA's constant folding then apply to what
    all rows share (e.g. no row of the shipped data has MLA or shared experts)."""
    def one(x):
        a = np.asarray(x)
        return float(a[0]) if a.ndim == 1 and a.size and np.all(a == a[0]) else x
    return jax.tree.map(one, tree)


def causal_flops_convention(row: BenchmarkRow) -> bool:
    """True for sources whose model TFLOP/s count causal (half) attention FLOPs: Megatron-Bridge
    tables (see benchmarks_data/SOURCES.md, 'Two model-FLOP conventions')."""
    return "megatron-bridge" in row.source.lower() or row.id.startswith("mbridge")


#: Validation evaluates a few hundred rows once: compile time dominates, so LLVM's expensive
#: optimisation passes (2x the compile time, nothing measurable at run time here) are skipped.
FAST_COMPILE = {"xla_llvm_disable_expensive_passes": True}

#: Rows per compiled evaluation (the shape every chunk is padded to; fewer rows use the
#: smallest power of two >= their count, so that small inputs compile a small program and
#: inputs of similar size share one). Measured on a 2-core CPU: once compiled, a 4,096-row
#: chunk takes ~9 ms (training) / ~2 ms (inference); the compilation (~10 s and ~370 MB per
#: kind, whatever the chunk size) and building the specs cost far more.
CHUNK_ROWS = 4096
#: Rows whose specs are built per call while stacking (each call checks them all at once).
STACK_ROWS = 4096


class StackedRows(NamedTuple):
    """Specs of the evaluable rows of one kind, stacked along a leading row axis (built with
    the float dtype in force when called: float64 under `jax_enable_x64`)."""

    rows: list  # the BenchmarkRows that could be turned into specs, in order
    models: object  # stacked Transformer
    systems: object  # stacked System
    plans: object  # stacked TrainingPlan / InferencePlan
    failed: list  # [{"id", "error"}] of rows whose specs are invalid
    runtimes: object = None  # stacked Runtime of each row (`row_runtimes`)


# ------------------------------------------------------------------------------- stacking
def columns(rows: list[BenchmarkRow], keys, defaults: dict[str, float]) -> dict[str, np.ndarray]:
    """The values of `keys` and of `defaults`' keys in `rows`, one float64 array per key (a row
    without a key of `defaults` gets its default; a value that is not a number raises
    ValueError)."""
    out = {}
    for k in (*keys, *defaults):
        vals = [r.values[k] if k in r.values or k not in defaults else defaults[k] for r in rows]
        try:
            out[k] = np.asarray(vals, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"{k}: not a number in every row") from None
    return out


def spec_field(owner, field: str, values: list) -> np.ndarray:
    """`values` (numbers, or names such as `'bf16'` and `'selective'`) as the numbers field
    `field` of spec class `owner` stores, converted by that field's own converter (once per
    distinct value); a value it refuses raises its ValueError."""
    convert = {f.name: f for f in dataclasses.fields(owner)}[field].metadata["converter"]
    table = {x: float(np.asarray(convert(x))) for x in dict.fromkeys(values)}
    return np.asarray([table[x] for x in values], dtype=np.float64)


def gpus_per_node_ok(values: dict) -> bool:
    """The check of `row_system`: `gpus_per_node` is a whole number >= 1."""
    n = values["gpus_per_node"]
    return bool(n >= 1 and n == round(n))


def row_systems(rows: list[BenchmarkRow]):
    """The stacked `System` of each row (`row_system`: its GPU preset with `gpus_per_node` GPUs
    per NVLink domain), built once per distinct (gpu, gpus_per_node) and gathered."""
    keys = [(r.values["gpu"], r.values["gpus_per_node"]) for r in rows]
    distinct = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    table = stack([row_system({"gpu": g, "gpus_per_node": n}) for g, n in distinct])
    return gather(table, np.asarray([distinct[k] for k in keys]))


def gather(table, index: np.ndarray):
    """Rows `index` of a stacked pytree `table` (gathered on the host: JAX would compile a
    gather for every length of `index`)."""
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x)[index]), table)


def _with_row_axis(specs, n: int = 1):
    """Specs whose leaves are one value each (a single configuration, or fields a batch left
    at their default) as a batch of `n` rows (on the host, for the reason of `gather`)."""
    return jax.tree.map(lambda x: x if np.ndim(x) else jnp.asarray(np.full(n, np.asarray(x))),
                        specs)


def _concatenate(parts: list):
    """Stacked specs of consecutive batches joined along the row axis."""
    if len(parts) == 1:
        return parts[0]
    return jax.tree.map(lambda *xs: jnp.asarray(np.concatenate([np.asarray(x) for x in xs])),
                        *parts)


def _pieces(rows, to_specs, batched) -> tuple[list, list, list]:
    """(ok rows, [stacked specs of consecutive ok rows], failed) of `rows`, in order: one
    `batched` call when every row is valid, halves otherwise, single rows through `to_specs`
    (which names what is wrong with a row)."""
    if len(rows) == 1:
        try:
            return list(rows), [_with_row_axis(to_specs(rows[0]))], []
        except ValueError as e:
            return [], [], [{"id": rows[0].id, "error": str(e)}]
    try:
        # fields left at their defaults are single values: one per row, as stacking gives
        return list(rows), [_with_row_axis(batched(rows), len(rows))], []
    except ValueError:
        mid = len(rows) // 2
        a, b = _pieces(rows[:mid], to_specs, batched), _pieces(rows[mid:], to_specs, batched)
        return a[0] + b[0], a[1] + b[1], a[2] + b[2]


def stack_specs(rows: list[BenchmarkRow], to_specs, batched=None, screen=None,
                progress: Progress | None = None) -> StackedRows:
    """Stack the `(Transformer, System, plan)` that `to_specs(row)` builds for every row (rows
    whose specs raise ValueError go to `failed`, with that error). Models are None when no row
    is valid.

    `batched(rows)`: the same specs for several rows at once (leaves of shape [n]; raises
    ValueError when any row is invalid), `STACK_ROWS` rows per call: per-row construction costs
    ~2-4 ms (100,000 rows: minutes). A batch that raises is halved until the invalid rows are
    single, and those go through `to_specs` for their message. `screen(row)`: False for a row
    that fails a check `batched` does not make (it goes through `to_specs` directly)."""
    if batched is None:
        ok, failed, specs = [], [], []
        for row in rows:
            try:
                specs.append(to_specs(row))
                ok.append(row)
            except ValueError as e:
                failed.append({"id": row.id, "error": str(e)})
        if not ok:
            return StackedRows([], None, None, None, failed)
        models, systems, plans = (stack([s[i] for s in specs]) for i in range(3))
        return StackedRows(ok, models, systems, plans, failed)
    ok, parts, failed = [], [], []
    step = STACK_ROWS
    for start in range(0, len(rows), step):
        run: list[BenchmarkRow] = []
        for row in [*rows[start:start + step], None]:
            if row is not None and (screen is None or screen(row)):
                run.append(row)
                continue
            for group in ([run] if run else []) + ([[row]] if row is not None else []):
                o, p, f = _pieces(group, to_specs, batched)
                ok += o
                parts += p
                failed += f
            run = []
        if progress is not None:
            progress.update(min(start + step, len(rows)))
    if not ok:
        return StackedRows([], None, None, None, failed)
    models, systems, plans = _concatenate(parts)
    return StackedRows(ok, models, systems, plans, failed)


def row_efficiencies(rows: list[BenchmarkRow], efficiency: Efficiency | None):
    """One `Efficiency` per row, stacked: each row's GPU factors (see `resolve_efficiency`),
    resolved once per GPU and gathered."""
    gpus = [r.values["gpu"] for r in rows]
    distinct = {g: i for i, g in enumerate(dict.fromkeys(gpus))}
    table = stack([resolve_efficiency(efficiency, g) for g in distinct])
    return gather(table, np.asarray([distinct[g] for g in gpus]))


def row_runtimes(rows: list[BenchmarkRow]):
    """One `Runtime` per row, stacked: the preset its `runtime` column names (empty: the
    default), resolved once per runtime and gathered."""
    names = [r.values.get("runtime", DEFAULT_RUNTIME) for r in rows]
    distinct = {n: i for i, n in enumerate(dict.fromkeys(names))}
    table = stack([runtime(n) for n in distinct])
    return gather(table, np.asarray([distinct[n] for n in names]))


def release_freed_memory() -> None:
    """Hand the heap memory freed so far back to the operating system (glibc's `malloc_trim`;
    nothing elsewhere). Reading a 100,000-row CSV (pandas' frame of strings, then one dict per
    row) leaves ~250 MB freed but still resident; the compiler's and the evaluation's larger
    allocations do not reuse it, so without this they would add to it."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------- evaluation
def chunk_rows(n: int, chunk: int | None = None) -> int:
    """Rows per compiled call for `n` rows: `chunk` (default `CHUNK_ROWS`), or the smallest
    power of two >= n when that is smaller (at least 8)."""
    chunk = CHUNK_ROWS if chunk is None else chunk
    return int(min(chunk, max(8, 1 << max(0, math.ceil(math.log2(max(n, 1)))))))


def chunks(n: int, chunk: int | None = None) -> Iterator[tuple[int, int, np.ndarray]]:
    """`(start, stop, index)` of the chunks of `n` rows: `index` holds `chunk_rows(n)` row
    indices, the rows start..stop-1, the last chunk padded by repeating its last row (so that
    every chunk has the one shape a compiled program takes)."""
    size = chunk_rows(n, chunk)
    for start in range(0, n, size):
        stop = min(start + size, n)
        yield start, stop, np.minimum(np.arange(start, start + size), stop - 1)


def take(tree, index):
    """The rows `index` (an index array, or one row) of a stacked pytree, as host (NumPy)
    arrays."""
    return jax.tree.map(lambda x: np.asarray(x)[index], tree)


def evaluate_chunks(fn: Callable, args: tuple, n: int, keep: Callable,
                    progress: Progress | None = None, chunk: int | None = None) -> dict:
    """`keep(fn(*chunk of args))` (a dict of [rows] arrays) over every chunk of the `n` rows of
    the stacked pytrees `args`, as one dict of NumPy arrays of length n. `fn` is called with
    `chunk_rows(n)` rows each time (one compiled program for all chunks)."""
    out: dict[str, list] = {}
    for start, stop, index in chunks(n, chunk):
        result = jax.device_get(keep(fn(*take(args, index))))
        for k, v in result.items():
            out.setdefault(k, []).append(np.asarray(v)[:stop - start])
        if progress is not None:
            progress.update(stop)
    return {k: np.concatenate(v) for k, v in out.items()}


class Progress:
    """Progress of a long job on stderr: rows done, rows/s and the time left.

    Silent for fewer than `min_rows` rows. On a terminal one line is rewritten in place (at
    most twice a second); otherwise (a log file, a pipe) a line is printed at most every
    `every` seconds, and a last one when the job is done. `start(total, label)` begins a
    stage (e.g. building the specs, then evaluating the rows)."""

    def __init__(self, enabled: bool = True, min_rows: int = 5_000, every: float = 10.0,
                 stream=None):
        self.enabled, self.min_rows, self.every = enabled, min_rows, every
        self.stream = sys.stderr if stream is None else stream
        self.t0 = time.perf_counter()
        self.total, self.label, self.start_time, self.last, self.open = 0, "", 0.0, 0.0, False
        self.first: tuple[float, int] | None = None

    @property
    def active(self) -> bool:
        return self.enabled and self.total >= self.min_rows

    def _tty(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def start(self, total: int, label: str, note: str = "") -> Progress:
        """Begin a stage of `total` rows (its first line says so, with `note`)."""
        self.close()
        self.total, self.label, self.first = total, label, None
        self.start_time = self.last = time.perf_counter()
        if self.active:
            self._print(f"[{self.start_time - self.t0:6.1f} s] {label}: {total:,} rows"
                        + (f" ({note})" if note else "") + "...")
        return self

    def _print(self, msg: str) -> None:
        if self._tty():
            print("\r" + msg.ljust(96), end="", file=self.stream, flush=True)
            self.open = True
        else:
            print(msg, file=self.stream, flush=True)

    def update(self, done: int) -> None:
        """`done` rows of the stage are finished. The rate and the time left are measured from
        the first update on (the first chunk also pays the compilation)."""
        if not self.active:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = (now, done)
        finished = done >= self.total
        if not finished and now - self.last < (0.5 if self._tty() else self.every):
            return
        self.last = now
        t1, d1 = self.first
        rate = (done - d1) / (now - t1) if done > d1 and now > t1 else None
        if rate is None or finished:
            rate = done / max(now - self.start_time, 1e-9)
        eta = "" if finished or done == d1 else f", about {(self.total - done) / rate:.0f} s left"
        self._print(f"[{now - self.t0:6.1f} s] {self.label}: {done:,}/{self.total:,} rows "
                    f"({done / self.total:.0%}), {rate:,.0f} rows/s{eta}")
        if finished:
            self.close()

    def close(self) -> None:
        if self.open:
            print(file=self.stream, flush=True)
            self.open = False


def capacity_warning(reason: int, memory_total, capacity, host_total=None,
                     host_capacity=None) -> str | None:
    """The message of a plan that does not fit in HBM (reason 10) or, with offloading, in host
    memory (reason 12), with the numbers; None for other reasons. HBM is checked first, so an
    HBM overflow also names a host-memory overflow."""
    has_host = host_total is not None and host_capacity is not None
    host = (explain(12, float(host_total), float(host_capacity)) if has_host else explain(12))
    if reason == 12:
        return host
    if reason != 10:
        return None
    text = explain(10, float(memory_total), float(capacity))
    return f"{text}; {host}" if has_host and float(host_total) > float(host_capacity) else text
