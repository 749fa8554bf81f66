"""The tensor-parallel all-reduce of an inference engine: its own one-shot / two-shot kernels
over NVLink peer-to-peer memory for small messages, NCCL for large ones.

TensorRT-LLM (`AllReduceStrategy.AUTO`), vLLM (`custom_all_reduce`) and SGLang replace NCCL's
ring inside one NVLink domain with kernels that read the peers' buffers directly:

- one-shot: every rank signals the others (a barrier over flags), then reads the n - 1 peer
  buffers whole and sums them: t_1 = A + (n - 1) S / (f_1 B);
- two-shot: a reduce-scatter and an all-gather the same way, each moving (n - 1) / n of the
  message through the rank's links, with a barrier each: t_2 = 2 A + 2 (n - 1) / n S / (f_2 B);

with S the message (bytes), B = `Network.nvlink_bandwidth` x `Efficiency.nvlink` (the ring's
achieved bandwidth), A = `ENGINE_ALL_REDUCE_LATENCY` + `ENGINE_ALL_REDUCE_LATENCY_PER_RANK` x
(n - 2) (a CUDA-graph replay's launch, the flag barrier and the reduction's start; more peers'
flags with more ranks) and f_1, f_2 the fractions of B the peer loads reach
(`ONE_SHOT_BANDWIDTH`, `TWO_SHOT_BANDWIDTH`). The engines pick the strategy by size and fall
back to NCCL for large messages, so the time is the smooth minimum (`smooth_min_of`) of t_1,
t_2 and NCCL's ring (`all_reduce`).

The four constants are fitted (`python calibration/allreduce_kernels.py --fit`) to NVIDIA's
measured all-reduce of those engines (AIConfigurator's `custom_allreduce_perf` tables:
TensorRT-LLM 1.0 on A100, 1.3 on H100 and B200, vLLM 0.14 on A100 and H100, SGLang 0.5.14 on
H100, CUDA-graph replays, bf16, 2 / 4 / 8 GPUs, 256 B to 1 GB;
`benchmarks_data/allreduce_kernels_published.csv`). There, a 16-KB all-reduce over 8 H100s
takes 3.7-5.2 us, where NCCL's ring (its LL protocol's 14 steps and the call's fixed cost)
takes about 20; from about 8 MB up the engines' times are NCCL's.

A group that leaves the NVLink domain (the engines' peer-to-peer kernels need every rank in
one domain) or has more than `ENGINE_ALL_REDUCE_MAX_RANKS` ranks (vLLM's and SGLang's custom
all-reduce take 2-8 GPUs; the fit saw 2, 4 and 8 on 8-GPU boards, so larger NVLink domains such
as NVL72 would be an extrapolation) always runs NCCL's hierarchical ring. The time is the
kernel's as measured in CUDA-graph replays; an eager pass charges it no separate launch."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..specs._efficiency import Efficiency
from ..specs._hardware import Network
from ._collectives import all_reduce, smooth_min_of

#: Latency of one barrier stage of an engine's all-reduce kernel between 2 ranks in a CUDA-graph
#: replay, s (fitted, see the module docstring).
ENGINE_ALL_REDUCE_LATENCY = 3.74e-6
#: More latency per rank beyond 2 (more peers' flags to wait for), s (fitted).
ENGINE_ALL_REDUCE_LATENCY_PER_RANK = 0.20e-6
#: Fraction of the ring's achieved NVLink bandwidth a one-shot kernel's peer loads reach (fitted).
ONE_SHOT_BANDWIDTH = 0.68
#: Fraction of the ring's achieved NVLink bandwidth a two-shot kernel reaches (fitted).
TWO_SHOT_BANDWIDTH = 0.56
#: Largest tensor-parallel group the engines' own all-reduce kernels serve (vLLM's and
#: SGLang's custom all-reduce: 2, 4, 6 or 8 GPUs); larger groups run NCCL's ring.
ENGINE_ALL_REDUCE_MAX_RANKS = 8.0


def engine_all_reduce(net: Network, eff: Efficiency, size, n, custom=1.0) -> jax.Array:
    """Time of an inference engine's all-reduce of `size` bytes over `n` tensor-parallel
    ranks, s: the smooth minimum of its one-shot kernel, its two-shot kernel and NCCL's ring
    (`all_reduce`) when the group fits in one NVLink domain and has at most
    `ENGINE_ALL_REDUCE_MAX_RANKS` ranks (module docstring), NCCL's ring otherwise. `custom`
    in [0, 1] is the share of the engine's kernels (0: NCCL only, the model's all-reduce
    before engines' kernels were modelled); 0 for a group of one."""
    n = jnp.asarray(n, dtype=jnp.result_type(float))
    nccl = all_reduce(net, eff, size, n)
    bw = net.nvlink_bandwidth * eff.nvlink
    barrier = ENGINE_ALL_REDUCE_LATENCY + ENGINE_ALL_REDUCE_LATENCY_PER_RANK * (n - 2.0)
    one_shot = barrier + (n - 1.0) * size / (ONE_SHOT_BANDWIDTH * bw)
    two_shot = 2.0 * barrier + 2.0 * (n - 1.0) / n * size / (TWO_SHOT_BANDWIDTH * bw)
    in_domain = (n > 1.0) & (n <= jnp.minimum(net.nvlink_domain, ENGINE_ALL_REDUCE_MAX_RANKS))
    safe = [jnp.where(in_domain, t, 1.0) for t in (one_shot, two_shot, nccl)]
    fastest = jnp.where(in_domain, smooth_min_of(safe), nccl)
    return jnp.where(n > 1.0, (1.0 - custom) * nccl + custom * fastest, 0.0)
