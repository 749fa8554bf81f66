"""`collectives.all_to_all` against NCCL all-to-all latencies NVIDIA measured for DeepSeek-V3's
token dispatch and combine (arXiv:2603.07685 Table 7; `benchmarks_data/all_to_all_latency.csv`).
Each rank sends its 4,096 tokens' 8 routed copies of 7,168 16-bit values. The errors bounded
here were measured when the table was added: on H100 (EP 8 in one node, EP 16-64 across 2-8
nodes) at most 8 %; on GB200 NVL72 (all in one NVLink domain) 11-24 % too fast."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import diffperf as dp
from diffperf import collectives as coll
from diffperf.validate import efficiency_for

DATA = Path(__file__).resolve().parent.parent / "benchmarks_data" / "all_to_all_latency.csv"


NCCL = pd.read_csv(DATA).query("dispatcher == 'nccl-a2a'")


def _predicted(row) -> float:
    """The model's all-to-all time for one row of the table (EP ranks 1 apart), s."""
    size = row.tokens_per_rank * row.top_k * row.hidden * row.bytes_per_element
    net = dp.system(row.system).network
    return float(coll.all_to_all(net, efficiency_for(None, row.gpu), size, row.ep, 1.0))


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
    assert np.abs(err).max() <= 0.30


def test_leaving_the_node_costs_what_the_nic_costs():
    """Measured: EP 8 -> 16 on H100 is 4.6x slower (half the tokens then cross a 50 GB/s NIC
    instead of 450 GB/s NVLink); GB200 NVL72 keeps EP 64 on NVLink (1.3x). The model's ratios
    were within 7 % of these when the table was added."""
    for gpu, far in (("h100-sxm5-80gb", 16), ("gb200", 64)):
        near, wide = (next(NCCL[(NCCL["gpu"] == gpu) & (NCCL["ep"] == ep)].itertuples())
                      for ep in (8, far))
        ratio = _predicted(wide) / _predicted(near)
        assert ratio / (wide.dispatch_us / near.dispatch_us) == pytest.approx(1.0, abs=0.1)
