"""How long one kernel, GEMM or collective takes, with no phase: the roofline, the GEMM model
and the collectives (time = FLOPs / rate, bytes / bandwidth, and the smooth maximum of the two)."""

from ._collectives import (
    all_gather as all_gather,
    all_reduce as all_reduce,
    all_to_all as all_to_all,
    reduce_scatter as reduce_scatter,
    send_recv as send_recv,
    tier_split as tier_split,
)
from ._roofline import (
    GEMM_SHARPNESS as GEMM_SHARPNESS,
    SHARPNESS as SHARPNESS,
    bytes_per_element as bytes_per_element,
    ceil_div as ceil_div,
    exposed_after_overlap as exposed_after_overlap,
    gemm_time as gemm_time,
    op_time as op_time,
    peak_matmul_flops as peak_matmul_flops,
    smooth_max as smooth_max,
    tile_efficiency as tile_efficiency,
)
