"""Which resource binds each inference operation (Kundu et al. 2024, GEMM-level boundedness),
and the effect of DRAM (HBM) technology on latency.

An operation is *compute-bound* when its arithmetic intensity (FLOP per HBM byte) exceeds the
GPU's machine balance (peak FLOP/s / HBM B/s) - more precisely, when its compute time is the
largest of its four time components (compute, HBM traffic, network, kernel launch overhead).
A phase whose GPU waits for the host (an eager runtime issuing short kernels) gets one more row,
`host_wait`, bound by the `host`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..costs._roofline import peak_matmul_flops
from ..presets import resolve_efficiency
from ..specs._efficiency import Efficiency
from ..specs._hardware import System
from ..specs._inference_plan import InferencePlan
from ..specs._runtime import Runtime
from ..specs._transformer import Transformer
from ._infer import OP_KINDS, InferenceReport, infer, inference_ops

if TYPE_CHECKING:
    import pandas as pd

#: Resources an operation can be bound by, in the order of the `Cost` fields `boundedness` reads,
#: and the host (the `host_wait` row of a phase whose GPU waits for the host).
RESOURCES = ("compute", "memory", "network", "launch", "host")
#: Default HBM sweep of `dram_scaling`: per-GPU bandwidth of successive HBM generations, B/s.
HBM_GENERATIONS = {
    "HBM2e (2.0 TB/s)": 2.0e12,
    "HBM3 (3.35 TB/s)": 3.35e12,
    "HBM3e (4.8 TB/s)": 4.8e12,
    "HBM3e (8.0 TB/s)": 8.0e12,
    "HBM4 (13 TB/s)": 13.0e12,
}



def boundedness(model: Transformer, system: System, plan: InferencePlan,
                efficiency: Efficiency | None = None,
                runtime: Runtime | None = None,
                report: InferenceReport | None = None) -> pd.DataFrame:
    """Per-operation boundedness table of prefill and decode on one GPU.

    **Returns:** a DataFrame with one row per operation and phase: `phase`, `op`, `kind`,
    `kernels` (launches in the phase), `flops` (FLOP), `bytes` (HBM or network B),
    `intensity` (FLOP/B), `machine_balance` (peak FLOP/s at the plan's GEMM precision / HBM
    B/s, FLOP/B: the datasheet ridge point), `bound` (the largest of compute / memory /
    network / launch time at the fitted efficiencies, so an operation a little below the ridge
    point can be compute-bound where its achieved FLOP/s are lower than the peak),
    `compute_s`, `memory_s`, `network_s`, `launch_s`, `host_s`, `time_s` (s, summed over all
    executions in the phase: all layers, and all decode steps) and `share` (fraction of the
    phase's time). Operations that do not occur (e.g. the router of a dense model) are
    dropped. With a `runtime` whose host binds, each phase has a `host_wait` row (kind and
    bound `host`): the time the GPU waits for the host (`PhaseBreakdown.host`). `report`: the
    `infer` report of the same arguments where the caller has it (not evaluated again).
    """
    import pandas as pd
    eff = resolve_efficiency(efficiency)
    ops = jax.device_get(inference_ops(model, system, plan, eff, runtime=runtime))  # eager
    if report is None:  # the caller's `infer` of the same arguments saves evaluating it again
        report = infer(model, system, plan, eff, runtime)
    report = jax.device_get(report)
    waits = {"prefill": float(report.prefill.host), "decode": float(report.decode.host)}
    acc = system.accelerator
    balance = float(peak_matmul_flops(acc, plan.math_precision) / acc.hbm_bandwidth)
    rows = []
    for phase, costs in ops.items():
        total = sum(float(c.time) for c in costs.values()) + waits[phase]
        for name, c in costs.items():
            time = float(c.time)
            if float(c.kernels) == 0.0 and float(c.network) == 0.0:
                continue  # the op does not occur (router of a dense model, pp = 1)
            parts = [float(c.compute), float(c.memory), float(c.network), float(c.launch)]
            flops, nbytes = float(c.flops), float(c.bytes)
            rows.append({
                "phase": phase, "op": name, "kind": OP_KINDS[name], "kernels": float(c.kernels),
                "flops": flops, "bytes": nbytes,
                "intensity": flops / nbytes if nbytes > 0 else np.inf,
                "machine_balance": balance, "bound": RESOURCES[int(np.argmax(parts))],
                "compute_s": parts[0], "memory_s": parts[1], "network_s": parts[2],
                "launch_s": parts[3], "host_s": 0.0, "time_s": time, "share": time / total,
            })
        if waits[phase] > 1e-6 * total:  # below: the smooth overlap's residue, no row
            rows.append({
                "phase": phase, "op": "host_wait", "kind": "host", "kernels": 0.0, "flops": 0.0,
                "bytes": 0.0, "intensity": np.nan, "machine_balance": balance, "bound": "host",
                "compute_s": 0.0, "memory_s": 0.0, "network_s": 0.0, "launch_s": 0.0,
                "host_s": waits[phase], "time_s": waits[phase], "share": waits[phase] / total,
            })
    return pd.DataFrame(rows)


def bound_shares(df: pd.DataFrame) -> pd.DataFrame:
    """Fraction of each phase's time spent in operations bound by each resource."""
    return df.pivot_table(index="phase", columns="bound", values="share", aggfunc="sum",
                          fill_value=0.0)


@eqx.filter_jit
def _sweep(model, system, plan, eff, bandwidths):
    def one(bw):
        s = eqx.tree_at(lambda t: t.accelerator.hbm_bandwidth, system, bw)
        r = infer(model, s, plan, eff)
        return r.tpot, r.ttft, r.e2e_latency
    return jax.vmap(one)(bandwidths)


def dram_scaling(model: Transformer, system: System, plan: InferencePlan,
                 bandwidths=None, efficiency: Efficiency | None = None) -> pd.DataFrame:
    """Latency as a function of per-GPU HBM bandwidth (one vmapped call).

    **Arguments:**

    - `bandwidths`: dict label -> B/s, or a sequence of B/s (default: `HBM_GENERATIONS`).

    **Returns:** a DataFrame with `memory`, `hbm_bandwidth` (B/s), `tpot_s`, `ttft_s`,
    `e2e_latency_s` (s) and `e2e_speedup` relative to the first row.
    """
    import pandas as pd
    eff = resolve_efficiency(efficiency)
    if bandwidths is None:
        bandwidths = HBM_GENERATIONS
    if isinstance(bandwidths, dict):
        labels, values = list(bandwidths), list(bandwidths.values())
    else:
        values = [float(b) for b in np.ravel(bandwidths)]
        labels = [f"{b / 1e12:g} TB/s" for b in values]
    if not values or not all(np.isfinite(values)) or min(values) <= 0:
        raise ValueError(f"dram_scaling: bandwidths must be finite numbers > 0 B/s, got {values}")
    bw = jnp.asarray(values, dtype=jnp.result_type(float))
    tpot, ttft, e2e = jax.device_get(_sweep(model, system, plan, eff, bw))
    return pd.DataFrame({"memory": labels, "hbm_bandwidth": values, "tpot_s": tpot,
                         "ttft_s": ttft, "e2e_latency_s": e2e, "e2e_speedup": e2e[0] / e2e})
