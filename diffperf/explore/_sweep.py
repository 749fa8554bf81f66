"""The sweep engine: jit + vmap over chunks of a `Grid`, sharded over every device JAX sees,
with on-device reductions (top-k, reason histogram, binned Pareto front) so that only a few
hundred numbers per chunk ever reach the host.

Multi-host: call `jax.distributed.initialize(coordinator_address=..., num_processes=...,
process_id=...)` on every host before using this module (`diffperf search ... --distributed` does
it; docs/multihost.md has the recipes), then make the same `run_sweep` call on every process.
The processes first agree on one block size (the smallest any of them can hold) and check that
they sweep the same grid in the same blocks, raising `SweepMismatchError` otherwise; each then
evaluates the blocks `process_index::process_count` on its local devices, and the (small)
reductions are gathered with `jax.experimental.multihost_utils.process_allgather` and merged
with ties broken by the global flat index, so that any process count gives the same answer as
one process. `evaluate_all` is process-local: every process evaluates every point.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._grid import Grid

#: Largest block of inner-axis combinations evaluated per compiled call (the measured sweet
#: spot on a 2-core CPU); `block_limit` lowers it when memory is short.
MAX_BLOCK = 1 << 18
#: Rough device memory per point in flight (inputs, intermediates of the model, outputs), B.
BYTES_PER_POINT = 4096


#: Test hook and override: free host memory in bytes that `block_limit` assumes instead of
#: asking the operating system (e.g. `DIFFPERF_FREE_HOST_MEMORY=4e9`). The multi-host tests set
#: it on one process only to check that the processes still agree on one block size.
FREE_MEMORY_ENV = "DIFFPERF_FREE_HOST_MEMORY"


def free_host_memory() -> int | None:
    """Currently available host memory, B (`FREE_MEMORY_ENV` if set), or None if unknown."""
    text = os.environ.get(FREE_MEMORY_ENV, "").strip()
    if text:
        try:
            return int(float(text))
        except ValueError:
            raise ValueError(f"{FREE_MEMORY_ENV}={text!r}: expected a number of bytes"
                             ) from None
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def block_limit(n_devices: int = 1, max_block: int = MAX_BLOCK) -> int:
    """Points per compiled call on this process: `max_block`, capped so that the block's
    intermediates (`BYTES_PER_POINT` each) use at most a quarter of the currently available
    host memory (`free_host_memory`), but not below 1024 per device.

    It differs between hosts with different free memory: a multi-host sweep uses
    `agreed_block_limit` instead."""
    free = free_host_memory()
    if free is None:
        return max_block
    return int(min(max_block, max(1024 * n_devices, free // 4 // BYTES_PER_POINT)))


def agreed_block_limit(n_devices: int = 1, max_block: int = MAX_BLOCK) -> int:
    """`block_limit` of this process, or under `jax.distributed` the smallest over all
    processes (a collective: every process must call it), so that they cut the grid into the
    same blocks whatever memory each has free."""
    local = block_limit(n_devices, max_block)
    if jax.process_count() == 1:
        return local
    from jax.experimental.multihost_utils import process_allgather
    return int(np.min(np.asarray(process_allgather(np.int32(local)))))


class SweepMismatchError(ValueError):
    """The processes of a multi-host sweep disagree on what they sweep (the grid, its block
    size or the reductions): their results could not be merged into a correct answer."""


#: Number of secondary-objective (memory) bins of the Pareto front, log-spaced.
PARETO_BINS = 64


class Progress:
    """A minimal progress line on stderr (only when it is a terminal or `force`)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label = total, label
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.last = 0.0

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.5 and done < self.total):
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-9)
        print(f"\r{self.label}: {done:,}/{self.total:,} ({done / self.total:5.1%}) "
              f"{rate / 1e6:.2f} M/s", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


@dataclass
class SweepResult:
    """Reductions of a sweep (host NumPy arrays).

    - `evaluated`: points evaluated; `feasible`: how many were feasible.
    - `top_index`, `top_value`: flat indices and objective of the k best feasible points,
      ascending (inf-padded when fewer are feasible).
    - `reasons`: histogram of reason codes (index = code).
    - `front_index`, `front_value`, `front_secondary`: per secondary-objective bin, the best
      feasible point (for the Pareto front; -1 where a bin is empty).
    - `seconds`: wall time including compilation.
    """

    evaluated: int
    feasible: int
    top_index: np.ndarray
    top_value: np.ndarray
    reasons: np.ndarray
    front_index: np.ndarray
    front_value: np.ndarray
    front_secondary: np.ndarray
    seconds: float


def _mesh(devices) -> Mesh:
    return Mesh(np.asarray(devices), ("d",))


class _Blocks:
    """The grid as blocks: inner-axis combinations live on the devices once (sharded), outer
    axes are scalars per block. No per-point index arithmetic at run time."""

    def __init__(self, grid: Grid, devices, max_block: int):
        self.grid = grid
        self.outer, self.inner = grid.split(max_block)
        inner = grid.product(self.inner)
        n_inner = int(np.prod([grid.axes[n].size for n in self.inner]))
        nd = len(devices)
        padded = -(-n_inner // nd) * nd
        mesh = _mesh(devices)
        self.shard = NamedSharding(mesh, PartitionSpec("d"))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        fdt = jnp.result_type(float)
        self.inner_values = {k: jax.device_put(np.pad(v, (0, padded - n_inner), mode="edge")
                                               .astype(fdt), self.shard) for k, v in inner.items()}
        pos = np.arange(padded, dtype=np.int32)
        self.position = jax.device_put(pos, self.shard)
        self.valid = jax.device_put(pos < n_inner, self.shard)
        self.n_inner = n_inner
        self.n_outer = grid.size // n_inner

    def outer_values(self, i: int) -> dict:
        vals = self.grid.decode_host(np.asarray([i]), names=self.outer)
        return {k: jnp.asarray(v[0], dtype=jnp.result_type(float)) for k, v in vals.items()}

    def points(self, evaluate, outer: dict, inner: dict):
        return jax.vmap(lambda row: evaluate({**outer, **row}))(inner)


def run_sweep(grid: Grid, evaluate: Callable, k: int = 10, devices=None,
              progress: bool = True, secondary_bounds=(1e9, 1e12), label: str = "sweep",
              n_reasons: int = 32, max_block: int = MAX_BLOCK,
              sink: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None
              ) -> SweepResult:
    """Evaluate every point of `grid` and reduce on the device.

    **Arguments:**

    - `evaluate`: `values -> (objective, secondary, reason)` for ONE point given a dict of axis
      values (scalars); it is vmapped. Lower objective is better; reason 0 = feasible. The
      secondary objective (e.g. memory, B) bins the Pareto front (lower is better too).
    - `k`: how many best points to keep.
    - `devices`: devices to shard each block over (default: this process's local devices).
    - `secondary_bounds`: (low, high) of the log-spaced Pareto bins.
    - `max_block`: most inner-axis combinations per compiled call (bounds device memory).
    - `sink`: if given, called after each block with the block's feasible points (reason 0) as
      host arrays `(flat_index, objective, secondary)`, in increasing flat index; for
      streaming every feasible point to a file (it costs a device-to-host copy per block).
      Under `jax.distributed` each process's sink sees only that process's blocks.

    Under `jax.distributed` every process must make this same call: the processes agree on
    the block size (`agreed_block_limit`), check that they sweep the same grid in the same
    blocks (`SweepMismatchError` otherwise), split the blocks and merge their reductions with
    ties broken by the global flat index, so that the result is the one a single process
    gives. The `evaluate` function itself cannot be compared: it must be the same everywhere.
    """
    t0 = time.perf_counter()
    devices = list(jax.local_devices() if devices is None else devices)
    block = agreed_block_limit(len(devices), max_block)
    index, count = jax.process_index(), jax.process_count()
    blocks = _Blocks(grid, devices, block)
    k = int(min(k, blocks.n_inner))
    if count > 1:
        _check_agreement(grid, blocks, k, secondary_bounds, n_reasons)
    carry = _local_reductions(grid, evaluate, blocks, k, secondary_bounds, n_reasons,
                              index, count, progress, label, sink)
    if count > 1:
        from jax.experimental.multihost_utils import process_allgather
        parts = tuple(np.asarray(process_allgather(x)) for x in carry)
    else:
        parts = tuple(x[None] for x in carry)
    top_v, top_i, hist, fv, fi, fs, nfeas = _merge(parts, k)
    return SweepResult(evaluated=grid.size, feasible=int(nfeas), top_index=top_i,
                       top_value=top_v, reasons=hist.astype(np.int64), front_index=fi,
                       front_value=fv, front_secondary=fs, seconds=time.perf_counter() - t0)


def _local_reductions(grid: Grid, evaluate: Callable, blocks: _Blocks, k: int,
                      secondary_bounds, n_reasons: int, index: int, count: int,
                      progress: bool = False, label: str = "sweep",
                      sink: Callable | None = None) -> tuple:
    """The reductions over the blocks `index::count` (this process's share), as host arrays
    (top values, top flat indices, reason histogram, per-bin best value / flat index /
    secondary, feasible count). Each is already ordered with ties to the smaller flat index."""
    lo, hi = np.log(secondary_bounds[0]), np.log(secondary_bounds[1])
    inf = jnp.inf

    def reduce_block(carry, obj, sec, reason, base, position, valid):
        top_v, top_i, hist, fv, fi, fs, nfeas = carry
        flat = base + position
        ok = valid & (reason == 0)
        key = jnp.where(ok, obj, inf)
        # lax.top_k puts the lower position first among equal values, and the blocks come in
        # increasing flat index, so ties go to the smaller flat index
        neg, idx = jax.lax.top_k(-key, k)
        cand_v = jnp.concatenate([top_v, -neg])
        cand_i = jnp.concatenate([top_i, flat[idx]])
        neg2, sel = jax.lax.top_k(-cand_v, k)
        top_v, top_i = -neg2, cand_i[sel]
        # scatter reductions (fast on CPU, unlike reductions over a one-hot matrix)
        hist = hist.at[jnp.where(valid, reason, n_reasons)].add(1, mode="drop")
        nfeas = nfeas + jnp.sum(ok, dtype=jnp.int32)
        # binned Pareto candidates: the best objective in each secondary bin
        b = jnp.clip(((jnp.log(sec) - lo) / (hi - lo) * PARETO_BINS).astype(jnp.int32), 0,
                     PARETO_BINS - 1)
        bmin = jnp.full((PARETO_BINS,), inf).at[b].min(key)
        # ties go to the smallest flat index, within and across blocks (order independent)
        big = jnp.iinfo(jnp.int32).max
        bidx = jnp.full((PARETO_BINS,), big, jnp.int32).at[b].min(
            jnp.where(ok & (key == bmin[b]), flat, big))
        bidx = jnp.where(bidx == big, -1, bidx)
        bsec = jnp.full((PARETO_BINS,), inf).at[b].min(jnp.where(flat == bidx[b], sec, inf))
        better = (bmin < fv) | ((bmin == fv) & (bidx >= 0) & ((fi < 0) | (bidx < fi)))
        fv = jnp.where(better, bmin, fv)
        fi = jnp.where(better, bidx, fi)
        fs = jnp.where(better, bsec, fs)
        return top_v, top_i, hist, fv, fi, fs, nfeas

    rep, shard = blocks.replicated, blocks.shard
    # Two compiled functions: the model over a block (large, elementwise, parallel) and the
    # reductions (small); fusing them makes XLA recompute / serialise the model.
    points = jax.jit(lambda outer, inner: blocks.points(evaluate, outer, inner),
                     in_shardings=(rep, shard), out_shardings=shard)
    reduce = jax.jit(reduce_block, in_shardings=(rep, shard, shard, shard, rep, shard, shard),
                     out_shardings=rep, donate_argnums=(0,))
    # Explicit dtypes: a weakly typed initial carry would compile `reduce` a second time for
    # the (strongly typed) carry it returns.
    real = jnp.result_type(float)  # float32, or float64 with jax_enable_x64
    carry = (jnp.full((k,), inf, real), jnp.full((k,), -1, jnp.int32),
             jnp.zeros(n_reasons, jnp.int32), jnp.full((PARETO_BINS,), inf, real),
             jnp.full((PARETO_BINS,), -1, jnp.int32), jnp.full((PARETO_BINS,), inf, real),
             jnp.zeros((), jnp.int32))
    carry = jax.device_put(carry, rep)
    mine = range(index, blocks.n_outer, count)
    bar = Progress(grid.size, label, enabled=progress)
    for n, i in enumerate(mine):
        obj, sec, reason = points(blocks.outer_values(i), blocks.inner_values)
        if sink is not None:
            _to_sink(sink, blocks.n_inner, i, *jax.device_get((obj, sec, reason)))
        carry = reduce(carry, obj, sec, reason, jnp.int32(i * blocks.n_inner), blocks.position,
                       blocks.valid)
        if progress and n % 8 == 7:
            jax.block_until_ready(carry)
            bar.update(min(grid.size, (i + 1) * blocks.n_inner))
    carry = jax.device_get(carry)
    bar.update(grid.size)
    bar.close()
    return tuple(np.asarray(x) for x in carry)


def _to_sink(sink: Callable, n_inner: int, block: int, obj, sec, reason) -> None:
    """Hand the feasible points of block `block` to `sink` (padding dropped)."""
    ok = np.asarray(reason)[:n_inner] == 0
    where = np.nonzero(ok)[0]
    sink(block * n_inner + where.astype(np.int64), np.asarray(obj)[:n_inner][ok],
         np.asarray(sec)[:n_inner][ok])


def _merge(parts: tuple, k: int) -> tuple:
    """Merge the reductions of several processes (each array with a leading process axis) into
    one, breaking every tie by the global flat index (never by the process number), so that
    the answer does not depend on how the blocks were shared out. Top-k entries that are not
    feasible (infinite value) get index -1, as do empty Pareto bins."""
    top_v, top_i, hist, fv, fi, fs, nfeas = parts
    big = np.iinfo(np.int64).max
    v, i = top_v.ravel(), top_i.ravel().astype(np.int64)
    i = np.where(np.isfinite(v), i, -1)
    order = np.lexsort((np.where(i < 0, big, i), v))[:k]
    top_v, top_i = v[order], i[order].astype(np.int32)
    # per Pareto bin: the smallest value, then the smallest flat index (empty bins last)
    fkey = np.where(fi < 0, big, fi.astype(np.int64))
    best = np.lexsort((fkey.T, fv.T), axis=-1)[:, 0]
    cols = np.arange(fv.shape[1])
    fv, fi, fs = fv[best, cols], fi[best, cols], fs[best, cols]
    return top_v, top_i, hist.sum(0), fv, fi, fs, nfeas.sum()


def _split64(n: int) -> list[int]:
    """A non-negative integer below 2**62 as two int32 words (collectives carry int32 when
    x64 is off)."""
    return [int(n) >> 31, int(n) & 0x7FFFFFFF]


def _check_agreement(grid: Grid, blocks: _Blocks, k: int, secondary_bounds,
                     n_reasons: int) -> None:
    """Under `jax.distributed`: raise `SweepMismatchError` (on every process) unless all
    processes sweep the same grid (axes and values) in the same blocks with the same
    reductions. A collective: every process must call it."""
    from jax.experimental.multihost_utils import process_allgather
    what = repr((grid.names, [np.asarray(grid.axes[n]).tolist() for n in grid.names],
                 k, n_reasons, [float(x) for x in secondary_bounds],
                 str(jnp.result_type(float))))
    digest = np.frombuffer(hashlib.sha256(what.encode()).digest()[:8], np.int32)
    mine = np.asarray([*_split64(grid.size), blocks.n_inner, blocks.n_outer, k, n_reasons,
                       *digest.tolist()], np.int32)
    every = np.asarray(process_allgather(mine)).astype(np.int64)
    differ = np.nonzero((every != every[0]).any(axis=1))[0]
    if differ.size:
        def text(row) -> str:
            size = (int(row[0]) << 31) | int(row[1])
            return (f"{size:,} points in {row[3]:,} blocks of {row[2]:,}, top {row[4]}, "
                    f"grid/settings hash {int(row[6]) & 0xFFFFFFFF:08x}"
                    f"{int(row[7]) & 0xFFFFFFFF:08x}")
        j = int(differ[0])
        raise SweepMismatchError(
            f"the {len(every)} processes of this multi-host sweep disagree: process 0 sweeps "
            f"{text(every[0])}, process {j} sweeps {text(every[j])}; start every process with "
            f"the same command (grid, options and diffperf / JAX versions)")


def pareto_front(values: np.ndarray, secondary: np.ndarray) -> np.ndarray:
    """Indices of the points not dominated in (values, secondary), both lower-is-better,
    sorted by secondary."""
    ok = np.isfinite(values) & np.isfinite(secondary)
    idx = np.nonzero(ok)[0]
    idx = idx[np.lexsort((values[idx], secondary[idx]))]
    front, best = [], np.inf
    for i in idx:
        if values[i] < best:
            front.append(i)
            best = values[i]
    return np.asarray(front, dtype=np.int64)


def evaluate_all(grid: Grid, evaluate: Callable, devices=None, progress: bool = True,
                 max_block: int = MAX_BLOCK) -> dict:
    """Evaluate every point and return all outputs (a dict of host arrays, one entry per key of
    the dict `evaluate(values)` returns, in flat-index order). For grids that fit in memory.

    Process-local: it makes no collective call and uses only `devices` (default: this process's
    local devices), so under `jax.distributed` every process evaluates every point and gets the
    whole (identical) result; it is safe there but no faster. Its block size may differ
    between processes (each one's free memory): the outputs do not depend on it."""
    devices = list(jax.local_devices() if devices is None else devices)
    blocks = _Blocks(grid, devices, block_limit(len(devices), max_block))
    rep, shard = blocks.replicated, blocks.shard
    f = jax.jit(lambda outer, inner: blocks.points(evaluate, outer, inner),
                in_shardings=(rep, shard))
    outs, bar = [], Progress(grid.size, "sweep", enabled=progress)
    for i in range(blocks.n_outer):
        out = jax.device_get(f(blocks.outer_values(i), blocks.inner_values))
        outs.append({key: np.asarray(v)[:blocks.n_inner] for key, v in out.items()})
        bar.update((i + 1) * blocks.n_inner)
    bar.close()
    return {key: np.concatenate([o[key] for o in outs]) for key in outs[0]}
