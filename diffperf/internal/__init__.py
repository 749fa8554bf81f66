"""Semi-public helpers for the tests, the calibration scripts and the notebooks.

No stability promise: these names may change or go in any release. Everything here is defined in
a private module of a subpackage; `diffperf.internal` is the one place outside the package that
may reach for it. Module namespaces (`technology`, `codesign`, ...) stand for a whole study
module whose many parts the tests pin one by one."""

from .._checks import as_float as as_float, check_finite_report as check_finite_report
from .._paths import BENCHMARKS_DATA as BENCHMARKS
from ..calibrate import _fit as calibration
from ..calibrate._batch_predict import COLUMNS as COLUMNS
from ..calibrate._cv import folds as folds, summaries as summaries
from ..calibrate._error_data import use_cross_validated_error as use_cross_validated_error
from ..calibrate._fit import default_data_paths as default_data_paths
from ..calibrate._held_out import measure_held_out as measure_held_out
from ..calibrate._results import INFER_COLUMNS as INFER_COLUMNS, TRAIN_COLUMNS as TRAIN_COLUMNS
from ..calibrate._sources import source_group as source_group, twin_key as twin_key
from ..calibrate._uncertainty import (
    QUANTITIES as QUANTITIES,
    cell_parameter_sd as cell_parameter_sd,
    decode_quantity as decode_quantity,
    measurements as measurements,
    quantity_of as quantity_of,
    residual_sds as residual_sds,
)
from ..cli import _bench as bench
from ..cli._cache_path import cache_directory as cache_directory
from ..cli._calibrate import (
    add_calibrate_parser as add_calibrate_parser,
    run_calibrate as run_calibrate,
)
from ..cli._checks import check_writable as check_writable
from ..cli._compile_cache import disable_compilation_cache as disable_compilation_cache
from ..cli._infer import (
    add_infer_parser as add_infer_parser,
    bench_inference as bench_inference,
    run_infer as run_infer,
)
from ..cli._main import _os_error_message as os_error_message
from ..cli._search import (
    _latency_throughput_front as latency_throughput_front,
    _shown as search_columns_shown,
)
from ..costs import _collectives as collectives
from ..costs._gemm import split_k_gemm_cost as inference_gemm
from ..design import (
    _attribution as attribution,
    _codesign as codesign,
    _sensitivity as sensitivity,
    _technology as technology,
)
from ..explore import _search_training as search
from ..explore._search_training import REASON_GPUS as REASON_GPUS
from ..plots._validation_plot import CLIP_PCT as CLIP_PCT
from ..training._layer import head_time as training_head_time, layer_costs as training_layer_costs
from ..validation import _data as benchmark_data, _validate as validation
from ..validation._plausibility import SLACK as SLACK

__all__ = [
    "add_calibrate_parser", "add_infer_parser", "as_float", "attribution", "bench",
    "bench_inference", "benchmark_data", "BENCHMARKS", "cache_directory",
    "calibration", "cell_parameter_sd", "check_finite_report", "check_writable", "CLIP_PCT",
    "codesign", "collectives", "COLUMNS", "decode_quantity", "default_data_paths",
    "disable_compilation_cache", "folds", "INFER_COLUMNS", "inference_gemm",
    "latency_throughput_front", "measure_held_out", "measurements", "os_error_message",
    "QUANTITIES", "quantity_of", "REASON_GPUS", "residual_sds", "run_calibrate", "run_infer",
    "search", "search_columns_shown", "sensitivity", "SLACK", "source_group", "summaries",
    "technology", "TRAIN_COLUMNS", "training_head_time", "training_layer_costs", "twin_key",
    "use_cross_validated_error", "validation",
]
