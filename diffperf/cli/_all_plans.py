"""`search train|infer --all-plans FILE`: every feasible plan of a search, streamed to a CSV or
Parquet file in chunks as the sweep finds them (never all in memory)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._checks import CliError, check_writable

if TYPE_CHECKING:  # pandas is imported when a table is written (a fast CLI start)
    import pandas as pd

    from ..explore._grid import Grid

#: Rows gathered before a chunk is written (one Parquet row group each).
CHUNK_ROWS = 1 << 16


def _pyarrow():
    """(pyarrow, pyarrow.parquet): an optional dependency, not installed with diffperf, so
    imported by name when a Parquet file is asked for (ImportError without it)."""
    return importlib.import_module("pyarrow"), importlib.import_module("pyarrow.parquet")


def add_all_plans_argument(parser) -> None:
    """The `--all-plans FILE` option of `search train|infer`."""
    parser.add_argument(
        "--all-plans", default=None, metavar="FILE",
        help="also write every feasible plan evaluated to FILE.csv or FILE.parquet (parquet "
             "needs pyarrow), streamed in chunks: its axis values and objectives "
             "(train: flat_index, the grid's axes as swept, step_time_s, memory_gb)")


def check_all_plans(path: str, distributed: bool = False) -> None:
    """Refuse a file name or combination `AllPlansWriter` cannot write, before the search."""
    if distributed:
        raise CliError("--all-plans is not available with --distributed (each process "
                       "evaluates only its share of the plans)")
    if not path.endswith((".csv", ".parquet")):
        raise CliError(f"--all-plans {path!r}: use a .csv or .parquet file name")
    if path.endswith(".parquet"):
        try:
            _pyarrow()
        except ImportError:
            raise CliError("--all-plans: writing parquet needs pyarrow: pip install pyarrow "
                           "(or use .csv)") from None
    check_writable("--all-plans", path)


class AllPlansWriter:
    """A table written in chunks: `add(df)` any number of times, then `close()`. CSV by
    appending; Parquet with one row group per chunk (`pyarrow.parquet.ParquetWriter`)."""

    def __init__(self, path: str, chunk_rows: int = CHUNK_ROWS):
        self.path, self.chunk_rows = path, chunk_rows
        self.rows, self._n_pending = 0, 0
        self._pending: list[pd.DataFrame] = []
        self._file: Any = None  # the open CSV file or Parquet writer
        self._parquet: Any = None
        self._empty: pd.DataFrame | None = None  # the first (empty) frame: header / schema

    def add(self, df: pd.DataFrame) -> None:
        if self._empty is None:
            self._empty = df.iloc[:0]
        if len(df) == 0:  # (concatenating empty frames is deprecated in pandas)
            return
        self._pending.append(df)
        self._n_pending += len(df)
        if self._n_pending >= self.chunk_rows:
            self._flush()

    def _flush(self) -> None:
        import pandas as pd
        if not self._pending and self._file is not None:
            return
        df = (pd.concat(self._pending, ignore_index=True) if self._pending
              else self._empty if self._empty is not None else pd.DataFrame())
        self._pending, self._n_pending = [], 0
        if self.path.endswith(".parquet"):
            pa, pq = _pyarrow()
            table = pa.Table.from_pandas(df, preserve_index=False)
            if self._parquet is None:
                self._parquet = pq.ParquetWriter(self.path, table.schema)
                self._file = self._parquet
            self._parquet.write_table(table)
        else:
            first = self._file is None
            if first:
                self._file = open(self.path, "w", newline="")
            df.to_csv(self._file, header=first, index=False)
        self.rows += len(df)

    def close(self) -> int:
        """Write what is left (the header alone if no plan was feasible); the rows written."""
        self._flush()
        if self._file is not None:
            self._file.close()
        return self.rows


def sweep_sink(writer: AllPlansWriter, grid: Grid, objective: str, secondary: str,
               secondary_scale: float = 1.0) -> Callable[[np.ndarray, np.ndarray, np.ndarray],
                                                         None]:
    """A `run_sweep(..., sink=...)` callback that adds each block's feasible points to `writer`
    as rows: `flat_index`, the grid's axis values, `objective`, `secondary` (times
    `secondary_scale`)."""
    whole = {n: bool(np.all(np.asarray(v) == np.round(np.asarray(v))))
             for n, v in grid.axes.items()}  # axes of whole numbers are written as integers

    def sink(flat: np.ndarray, obj: np.ndarray, sec: np.ndarray) -> None:
        import pandas as pd
        if flat.size == 0 and writer._empty is not None:
            return
        values = grid.decode_host(flat)
        cols = {"flat_index": flat} | {n: v.astype(np.int64) if whole[n] else v
                                       for n, v in values.items()}
        cols |= {objective: obj, secondary: np.asarray(sec) * secondary_scale}
        writer.add(pd.DataFrame(cols))
    return sink


class _TrainSink:
    """`run_sweep`'s sink for `search train --all-plans` and the writer behind it."""

    def __init__(self, path: str, grid: Grid):
        self.path = path
        self.writer = AllPlansWriter(path)
        self.sink = sweep_sink(self.writer, grid, "step_time_s", "memory_gb", 1e-9)

    def __call__(self, flat, obj, sec) -> None:
        self.sink(flat, obj, sec)


def open_all_plans(args, grid: Grid) -> _TrainSink | None:
    """The `plan_sink` of `search train --all-plans FILE` (None without the option); the file
    is checked first."""
    if not getattr(args, "all_plans", None):
        return None
    check_all_plans(args.all_plans, getattr(args, "distributed", False))
    return _TrainSink(args.all_plans, grid)


def close_all_plans(sink: _TrainSink | None) -> None:
    if sink is not None:
        n = sink.writer.close()
        print(f"wrote {sink.path} ({n:,} feasible plans)", file=sys.stderr)


def write_all_inference_plans(args, feasible: pd.DataFrame) -> None:
    """`search infer --all-plans FILE`: the feasible rows of the (in-memory) inference table,
    written in chunks as `search train`'s."""
    if not getattr(args, "all_plans", None):
        return
    axes = [c for c in ("tp", "pp", "ep", "batch") if c in feasible]
    feasible = feasible[axes + [c for c in feasible if c not in axes
                                and c not in ("feasible", "reason")]]
    writer = AllPlansWriter(args.all_plans)
    for start in range(0, max(len(feasible), 1), CHUNK_ROWS):
        writer.add(feasible.iloc[start:start + CHUNK_ROWS])
    print(f"wrote {args.all_plans} ({writer.close():,} feasible plans)", file=sys.stderr)
