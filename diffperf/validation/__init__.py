"""Measured rows in, predictions and errors out: the benchmark CSV reader (the one record of the
metric columns), stacked rows, plausibility bounds and `validate`."""

from ._data import (
    BenchmarkError as BenchmarkError,
    BenchmarkRow as BenchmarkRow,
    read_benchmark_files as read_benchmark_files,
    read_benchmarks as read_benchmarks,
    train_specs as train_specs,
)
from ._infer_rows import infer_specs as infer_specs, predict_infer_rows as predict_infer_rows
from ._plausibility import (
    ideal_bounds as ideal_bounds,
    implausible_measurements as implausible_measurements,
)
from ._stack import stack as stack
from ._train_rows import predict_train_rows as predict_train_rows
from ._validate import validate as validate
