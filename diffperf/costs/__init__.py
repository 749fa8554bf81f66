"""How long one kernel, GEMM or collective takes, with no phase: the roofline, the `Cost` record
of one operation, the GEMM model, the fused-attention rate and the collectives (time = FLOPs /
rate, bytes / bandwidth, and the smooth maximum of the two)."""

from ._attention import (
    fused_attention_rate as fused_attention_rate,
    prefill_attention_time as prefill_attention_time,
)
from ._collectives import (
    all_gather as all_gather,
    all_reduce as all_reduce,
    all_to_all as all_to_all,
    reduce_scatter as reduce_scatter,
    send_recv as send_recv,
    tier_split as tier_split,
)
from ._cost import (
    Cost as Cost,
    compute_cost as compute_cost,
    kernel_time as kernel_time,
    network_cost as network_cost,
)
from ._engine_all_reduce import engine_all_reduce as engine_all_reduce
from ._gemm import (
    L2_REUSE as L2_REUSE,
    MMA_ROWS as MMA_ROWS,
    TILE as TILE,
    gemm_cost as gemm_cost,
    gemm_flops as gemm_flops,
    gemm_hbm_bytes as gemm_hbm_bytes,
    gemm_time as gemm_time,
    split_k_gemm_cost as split_k_gemm_cost,
    tile_efficiency as tile_efficiency,
)
from ._roofline import (
    GEMM_SHARPNESS as GEMM_SHARPNESS,
    OP_RESOURCES as OP_RESOURCES,
    SHARPNESS as SHARPNESS,
    OpCost as OpCost,
    bytes_per_element as bytes_per_element,
    ceil_div as ceil_div,
    exposed_after_overlap as exposed_after_overlap,
    op_cost as op_cost,
    op_time as op_time,
    peak_matmul_flops as peak_matmul_flops,
    smooth_max as smooth_max,
)
