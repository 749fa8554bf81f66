"""Serving under load: an engine's scheduler simulated iteration by iteration (in-flight
batching, chunked prefill, KV-cache admission) over a request stream, with latency
percentiles, throughput, cost and energy (docs/serving.md)."""

from ._disaggregated import (
    kv_transfer_time as kv_transfer_time,
    serve_disaggregated as serve_disaggregated,
)
from ._reference import reference_schedule as reference_schedule
from ._report import (
    Latency as Latency,
    ServingReport as ServingReport,
    binned_percentile as binned_percentile,
    masked_percentile as masked_percentile,
    report as report,
)
from ._search import (
    SLO_METRICS as SLO_METRICS,
    parse_slo as parse_slo,
    slo_search as slo_search,
)
from ._serve import serve as serve
from ._simulate import (
    Requests as Requests,
    Schedule as Schedule,
    reservation as reservation,
    simulate as simulate,
    split_times as split_times,
    step_bound as step_bound,
)
from ._traffic import (
    LENGTH_DISTRIBUTIONS as LENGTH_DISTRIBUTIONS,
    Traffic as Traffic,
    read_trace as read_trace,
    requests as requests,
)
from ._trtllm_bench import (
    kv_cache_requests as kv_cache_requests,
    trtllm_bench_engine_limits as trtllm_bench_engine_limits,
    trtllm_bench_limits as trtllm_bench_limits,
)
