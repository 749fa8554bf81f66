"""`collectives.all_to_all` against NCCL all-to-all latencies NVIDIA measured for DeepSeek-V3's
token dispatch and combine (arXiv:2603.07685 Table 7; `benchmarks_data/all_to_all_latency.csv`).
Each rank sends its 4,096 tokens' 8 routed copies of 7,168 16-bit values. The errors bounded
here were measured when the table was added: on H100 (EP 8 in one node, EP 16-64 across 2-8
nodes) at most 8 %; on GB200 NVL72 (all in one NVLink domain) 11-24 % too fast."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

import diffperf as dp
from diffperf import collectives as coll
from diffperf.validate import efficiency_for

DATA = Path(__file__).resolve().parent.parent / "benchmarks_data" / "all_to_all_latency.csv"


def _errors(gpu):
    table = pd.read_csv(DATA)
    rows = table[(table["dispatcher"] == "nccl-a2a") & (table["gpu"] == gpu)]
    assert len(rows) == 4
    out = []
    for r in rows.itertuples():
        size = r.tokens_per_rank * r.top_k * r.hidden * r.bytes_per_element
        net = dp.system(r.system).network
        predicted = float(coll.all_to_all(net, efficiency_for(None, gpu), size, r.ep, 1.0))
        for measured in (r.dispatch_us, r.combine_us):
            out.append(predicted / (measured * 1e-6) - 1.0)
    return np.array(out)


def test_h100_all_to_all_within_and_across_nodes():
    err = _errors("h100-sxm5-80gb")
    assert np.abs(err).max() <= 0.10


def test_gb200_nvl72_all_to_all():
    err = _errors("gb200")
    assert np.abs(err).max() <= 0.30


def test_leaving_the_node_costs_what_the_nic_costs():
    """Measured: EP 8 -> 16 on H100 is 4.6x slower (half the tokens then cross a 50 GB/s NIC
    instead of 450 GB/s NVLink); GB200 NVL72 keeps EP 64 on NVLink (1.3x)."""
    table = pd.read_csv(DATA).query("dispatcher == 'nccl-a2a'").set_index(["gpu", "ep"])
    for gpu, system, low, high in (("h100-sxm5-80gb", "dgx-h100", 3.5, 6.0),
                                   ("gb200", "gb200-nvl72", 1.0, 1.6)):
        net, eff = dp.system(system).network, efficiency_for(None, gpu)
        size = 4096 * 8 * 7168 * 2
        far = 16 if gpu.startswith("h100") else 64
        ratio = float(coll.all_to_all(net, eff, size, far) / coll.all_to_all(net, eff, size, 8))
        measured = table.loc[(gpu, far), "dispatch_us"] / table.loc[(gpu, 8), "dispatch_us"]
        assert low <= measured <= high and low <= ratio <= high
