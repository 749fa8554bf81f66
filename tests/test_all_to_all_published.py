"""`diffperf.costs.all_to_all` against NCCL all-to-all latencies NVIDIA measured for DeepSeek-V3's
token dispatch and combine (arXiv:2603.07685 Table 7; `benchmarks_data/all_to_all_latency.csv`).
Each rank sends its 4,096 tokens' 8 routed copies of 7,168 16-bit values. Inside an NVLink
domain the exchange runs at the `all_to_all` fraction of NVLink, whose default is set from these
in-domain rows (below). The errors bounded here: on H100 (EP 8 in one node, EP 16-64 across 2-8
nodes) -7 to +9 %; on GB200 NVL72 (all in one NVLink domain) -12 to +4 % (11-24 % too fast
while all-to-alls ran at the ring collectives' `nvlink` fraction)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import diffperf as dp
from diffperf.internal import collectives as coll
from diffperf.presets import resolve_efficiency

DATA = Path(__file__).resolve().parent.parent / "benchmarks_data" / "all_to_all_latency.csv"


NCCL = pd.read_csv(DATA).query("dispatcher == 'nccl-a2a'")


def _predicted(row) -> float:
    """The model's all-to-all time for one row of the table (EP ranks 1 apart), s."""
    size = row.tokens_per_rank * row.top_k * row.hidden * row.bytes_per_element
    net = dp.system(row.system).network
    return float(coll.all_to_all(net, resolve_efficiency(None, row.gpu), size, row.ep, 1.0))


def _errors(gpu):
    rows = NCCL[NCCL["gpu"] == gpu]
    assert len(rows) == 4
    return np.array([_predicted(r) / (measured * 1e-6) - 1.0 for r in rows.itertuples()
                     for measured in (r.dispatch_us, r.combine_us)])


def test_h100_all_to_all_within_and_across_nodes():
    err = _errors("h100-sxm5-80gb")
    assert np.abs(err).max() <= 0.10


def test_gb200_nvl72_all_to_all():
    err = _errors("gb200")
    assert np.abs(err).max() <= 0.15


def test_all_to_all_default_is_what_the_in_domain_rows_imply():
    """The default `all_to_all` fraction is the geometric mean of the fractions of NVLink
    bandwidth that the measured in-domain exchanges imply once the per-hop latency and the call
    overhead are taken off (0.58-0.73; H100 EP 8 reaches 0.72-0.73, GB200 0.58-0.69)."""
    implied = []
    for r in NCCL.itertuples():
        net = dp.system(r.system).network
        if r.ep > float(net.nvlink_domain):
            continue
        eff = resolve_efficiency(None, r.gpu)
        size = r.tokens_per_rank * r.top_k * r.hidden * r.bytes_per_element
        fixed = (r.ep - 1) * float(net.nvlink_latency) + float(eff.collective_overhead)
        for measured in (r.dispatch_us, r.combine_us):
            implied.append(size * (r.ep - 1) / r.ep / float(net.nvlink_bandwidth)
                           / (measured * 1e-6 - fixed))
    assert len(implied) == 10 and 0.55 < min(implied) and max(implied) < 0.75
    mean = float(np.exp(np.mean(np.log(implied))))
    assert float(dp.Efficiency().all_to_all) == pytest.approx(mean, rel=0.02)


def test_leaving_the_node_costs_what_the_nic_costs():
    """Measured: EP 8 -> 16 on H100 is 4.6x slower (half the tokens then cross a 50 GB/s NIC
    instead of 450 GB/s NVLink); GB200 NVL72 keeps EP 64 on NVLink (1.3x). The model's ratios
    are within 8 % (GB200) and 15 % (H100) of these: one `all_to_all` fraction serves both
    GPUs, and H100's in-node exchange reaches 0.73 of NVLink against GB200's 0.58-0.69, so the
    model's H100 EP 8 is 8-9 % slow and its ratio 15 % low (7 % while all-to-alls ran at the
    ring fraction, which left GB200 11-24 % fast)."""
    for gpu, far, tolerance in (("h100-sxm5-80gb", 16, 0.2), ("gb200", 64, 0.1)):
        near, wide = (next(NCCL[(NCCL["gpu"] == gpu) & (NCCL["ep"] == ep)].itertuples())
                      for ep in (8, far))
        ratio = _predicted(wide) / _predicted(near)
        measured = wide.dispatch_us / near.dispatch_us
        assert ratio / measured == pytest.approx(1.0, abs=tolerance)
