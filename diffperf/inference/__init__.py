"""One serving run: per-operation costs of prefill and decode, KV cache and the largest batch,
GEMM-level boundedness and DRAM scaling."""

from ._boundedness import (
    HBM_GENERATIONS as HBM_GENERATIONS,
    bound_shares as bound_shares,
    boundedness as boundedness,
    dram_scaling as dram_scaling,
)
from ._host import (
    collectives_per_layer as collectives_per_layer,
    graph_kernel_time as graph_kernel_time,
    graph_padded_batch as graph_padded_batch,
    graph_share as graph_share,
    host_issue_time as host_issue_time,
    host_wait as host_wait,
)
from ._infer import (
    Cost as Cost,
    InferenceMemory as InferenceMemory,
    InferenceReport as InferenceReport,
    busiest_gpu_experts as busiest_gpu_experts,
    expected_max_of_normals as expected_max_of_normals,
    experts_touched as experts_touched,
    infer as infer,
    inference_memory as inference_memory,
    inference_ops as inference_ops,
    kv_cache_bytes_per_gpu as kv_cache_bytes_per_gpu,
    max_batch as max_batch,
    phase_graphs as phase_graphs,
    weight_bytes_per_gpu as weight_bytes_per_gpu,
)
from ._iteration import (
    IterationCost as IterationCost,
    iteration_cost as iteration_cost,
    iteration_time as iteration_time,
    keys_read as keys_read,
    kv_bytes_per_token as kv_bytes_per_token,
    kv_capacity_tokens as kv_capacity_tokens,
)
from ._moe_module import MoeModuleTime as MoeModuleTime, moe_module_time as moe_module_time
