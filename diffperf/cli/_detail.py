"""`diffperf train --detail`: the full breakdown of a training step (`training_detail`) as a
JSON-ready dict and as readable tables."""

from __future__ import annotations

import jax

from ..costs._roofline import OP_RESOURCES
from ..presets import resolve_efficiency
from ..training._detail import COMM_TERMS, HEAD_OPS, LAYER_OPS, detail_of_report

#: `OpCost` fields and the JSON keys they get (times in s, bytes in B, FLOPs in FLOP).
_OP_FIELDS = {"flops": "flops", "hbm_bytes": "hbm_bytes", "l2_bytes": "l2_bytes",
              "network_bytes": "network_bytes", "kernels": "kernels", "compute": "compute_s",
              "memory": "memory_s", "l2": "l2_s", "network": "network_s", "launch": "launch_s",
              "time": "time_s"}
_TERM_FIELDS = {"message_bytes": "message_bytes", "calls": "calls", "bytes": "bytes",
                "link": "link_s", "hidden": "hidden_s", "exposed": "exposed_s"}


@jax.jit
def _jitted_detail(model, system, plan, efficiency, report):
    return detail_of_report(model, system, plan, efficiency, report)


def _op_row(cost) -> dict:
    row: dict[str, float | str] = {key: float(getattr(cost, f)) for f, key in _OP_FIELDS.items()}
    row["bound"] = OP_RESOURCES[int(cost.bound)]
    return row


def detail_summary(model, system, plan, efficiency, report) -> dict:
    """Plain-Python dict of `training_detail` for one configuration (the `"detail"` object of
    `diffperf train --json --detail`): `layer` (per pass, one row per operation in
    `LAYER_OPS` order, and the layer totals), `head`, `comm` (per term) and `step` totals.
    `report`: the configuration's `train_step`; `efficiency`: its factors (not None)."""
    d = jax.device_get(_jitted_detail(model, system, plan, resolve_efficiency(efficiency),
                                      report))
    passes = {"forward": d.forward, "backward": d.backward, "recompute": d.recompute}
    layer: dict = {name: {op: _op_row(ops[op]) for op in LAYER_OPS}
                   for name, ops in passes.items()}
    layer |= {"flops": float(d.layer_flops), "hbm_bytes": float(d.layer_hbm_bytes),
              "network_bytes": float(d.layer_network_bytes),
              "compute_time_s": float(d.layer_compute_time)}
    return {
        "layer": layer,
        "head": {op: _op_row(d.head[op]) for op in HEAD_OPS},
        "comm": {term: {key: float(getattr(d.comm[term], f)) for f, key in _TERM_FIELDS.items()}
                 for term in COMM_TERMS},
        "step": {"layers": float(d.layers), "micro_batches": float(d.micro_batches),
                 "flops": float(d.step_flops), "hbm_bytes": float(d.step_hbm_bytes),
                 "network_bytes": float(d.step_network_bytes)},
    }


def _occurs(row: dict) -> bool:
    return row["kernels"] > 0 or row["network_bytes"] > 0 or row["time_s"] > 0


def print_detail(detail: dict) -> None:
    """The tables of `diffperf train --detail` (`detail`: `detail_summary`)."""
    layer, step = detail["layer"], detail["step"]
    print(f"  per layer, one micro-batch on one GPU of the last stage ({step['layers']:g} layers "
          f"x {step['micro_batches']:g} micro-batches per step): FLOPs and bytes of the forward "
          f"pass (of the backward for a backward-only collective), the time of each pass "
          f"(collectives: link time, before overlap)")
    print(f"    {'operation':18s} {'GFLOP':>9s} {'HBM MB':>9s} {'net MB':>9s} {'fwd ms':>8s} "
          f"{'bwd ms':>8s} {'recomp ms':>9s}  bound")
    fwd, bwd, rec = layer["forward"], layer["backward"], layer["recompute"]
    for op in LAYER_OPS:
        if not (_occurs(fwd[op]) or _occurs(bwd[op])):
            continue  # not in this model / plan
        f = fwd[op] if _occurs(fwd[op]) else bwd[op]
        print(f"    {op:18s} {f['flops'] / 1e9:9.2f} {f['hbm_bytes'] / 1e6:9.2f} "
              f"{f['network_bytes'] / 1e6:9.2f} {fwd[op]['time_s'] * 1e3:8.3f} "
              f"{bwd[op]['time_s'] * 1e3:8.3f} {rec[op]['time_s'] * 1e3:9.3f}  {f['bound']}")
    print(f"    layer total (all passes): {layer['flops'] / 1e9:.2f} GFLOP, "
          f"{layer['hbm_bytes'] / 1e6:.1f} MB HBM, {layer['network_bytes'] / 1e6:.1f} MB "
          f"network, {layer['compute_time_s'] * 1e3:.3f} ms compute")
    head = ", ".join(f"{op} {row['time_s'] * 1e3:.3f} ms ({row['bound']})"
                     for op, row in detail["head"].items())
    print(f"  head per micro-batch (forward + backward): {head}")
    print(f"  per step on this GPU: {step['flops'] / 1e12:.2f} TFLOP, "
          f"{step['hbm_bytes'] / 1e9:.2f} GB HBM (layers and head), "
          f"{step['network_bytes'] / 1e9:.2f} GB network")
    print("  communication per step (link = hidden + exposed)")
    print(f"    {'term':19s} {'message MB':>10s} {'calls':>9s} {'link s':>9s} {'hidden s':>9s} "
          f"{'exposed s':>9s}")
    for term, t in detail["comm"].items():
        if t["calls"] == 0 and t["link_s"] == 0:
            continue  # no such communication in this plan
        print(f"    {term:19s} {t['message_bytes'] / 1e6:10.2f} {t['calls']:9.0f} "
              f"{t['link_s']:9.4f} {t['hidden_s']:9.4f} {t['exposed_s']:9.4f}")
