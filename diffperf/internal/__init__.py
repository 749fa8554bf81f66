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
from ..calibrate._fit import default_data_paths as default_data_paths
from ..calibrate._results import INFER_COLUMNS as INFER_COLUMNS, TRAIN_COLUMNS as TRAIN_COLUMNS
from ..calibrate._sources import source_group as source_group
from ..calibrate._uncertainty import (
    MOE_INFERENCE as MOE_INFERENCE,
    MOE_STEP_TIME as MOE_STEP_TIME,
    PRECISION_CLASS_NAMES as PRECISION_CLASS_NAMES,
    QUANTITIES as QUANTITIES,
    UNSEEN_INFERENCE as UNSEEN_INFERENCE,
    bias_text as bias_text,
    cell_parameter_sd as cell_parameter_sd,
    decode_quantity as decode_quantity,
    inference_floors as inference_floors,
    inference_support as inference_support,
    interval_caveats as interval_caveats,
    interval_coverage as interval_coverage,
    is_unseen_inference as is_unseen_inference,
    model_error_sd as model_error_sd,
    moe_inference_error as moe_inference_error,
    moe_step_error as moe_step_error,
    quantity_of as quantity_of,
    require_measured_kind as require_measured_kind,
    residual_sds as residual_sds,
    training_quantity as training_quantity,
    unseen_inference_error as unseen_inference_error,
    use_cross_validated_error as use_cross_validated_error,
)
from ..cli import _bench as bench
from ..cli._calibrate import measure_inference_errors as measure_inference_errors
from ..cli._compile_cache import cache_directory as cache_directory
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
from ..design import (
    _attribution as attribution,
    _codesign as codesign,
    _sensitivity as sensitivity,
    _technology as technology,
)
from ..explore import _search_training as search
from ..explore._search_training import REASON_GPUS as REASON_GPUS
from ..inference._infer import _gemm as inference_gemm
from ..plots._validation_plot import CLIP_PCT as CLIP_PCT
from ..training._step import _head_time as training_head_time, _layer_costs as training_layer_costs
from ..validation import _data as benchmark_data, _validate as validation
from ..validation._plausibility import SLACK as SLACK
