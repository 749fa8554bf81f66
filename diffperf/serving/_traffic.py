"""Request traffic: when requests arrive and how long their prompts and outputs are.

Open loop: Poisson arrivals at `rate` requests/s (exponential gaps), or all at t = 0 for an
infinite rate (the offline maximum-throughput benchmarks: trtllm-bench, `vllm bench
throughput`), or a trace. Closed loop: `concurrency` clients, each sending its next request
when the previous one finishes (`benchmark_serving --max-concurrency`, genai-perf
`--concurrency`).

Lengths: fixed, or normal with a standard deviation, rounded and clipped to >= 1 (TensorRT-LLM's
`prepare_dataset.py token-norm-dist`), or uniform on [mean (1 - r), mean (1 + r)] (vLLM's
`benchmark_serving --random-range-ratio r`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .._checks import MAX_EXACT_COUNT

#: Length distributions of `Traffic`.
LENGTH_DISTRIBUTIONS = ("fixed", "normal", "uniform")


@dataclasses.dataclass(frozen=True)
class Traffic:
    """A request stream to generate (`requests`).

    **Arguments:**

    - `rate`: mean arrival rate, requests/s (Poisson); `math.inf` sends all at t = 0.
    - `num_requests`: requests in the stream, count.
    - `input_len`, `output_len`: mean prompt and output lengths, tokens.
    - `input_spread`, `output_spread`: the standard deviation (`distribution="normal"`, tokens)
      or the range ratio r (`"uniform"`); ignored for `"fixed"`.
    - `distribution`: `"fixed"`, `"normal"` or `"uniform"`.
    - `concurrency`: clients of a closed loop (0: open loop at `rate`), count.
    - `seed`: random seed of the arrivals and lengths.
    """

    rate: float = math.inf
    num_requests: int = 1000
    input_len: float = 1024
    output_len: float = 256
    input_spread: float = 0.0
    output_spread: float = 0.0
    distribution: str = "fixed"
    concurrency: int = 0
    seed: int = 0

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"Traffic.{field} {why}, got {getattr(self, field)!r}")
        if not (isinstance(self.num_requests, int) and 1 <= self.num_requests <= MAX_EXACT_COUNT):
            bad("num_requests", "must be a whole number >= 1")
        if not self.rate > 0 or math.isnan(self.rate):
            bad("rate", "must be > 0 requests/s (inf: all at once)")
        for f in ("input_len", "output_len"):
            v = getattr(self, f)
            if not (math.isfinite(v) and 1 <= v <= MAX_EXACT_COUNT):
                bad(f, "must be a number of tokens >= 1")
        for f in ("input_spread", "output_spread"):
            if not (math.isfinite(getattr(self, f)) and getattr(self, f) >= 0):
                bad(f, "must be >= 0")
        if self.distribution not in LENGTH_DISTRIBUTIONS:
            bad("distribution", f"must be one of {', '.join(LENGTH_DISTRIBUTIONS)}")
        if self.distribution == "uniform":
            for f in ("input_spread", "output_spread"):
                if getattr(self, f) > 1:
                    bad(f, "must be a range ratio in [0, 1] for a uniform distribution")
        if not (isinstance(self.concurrency, int) and self.concurrency >= 0):
            bad("concurrency", "must be a whole number >= 0 (0: open loop)")


def _lengths(rng, mean, spread, distribution, n) -> np.ndarray:
    if distribution == "normal" and spread > 0:
        x = rng.normal(mean, spread, n)
    elif distribution == "uniform" and spread > 0:
        x = rng.uniform(mean * (1 - spread), mean * (1 + spread), n)
    else:
        x = np.full(n, float(mean))
    return np.clip(np.round(x), 1, MAX_EXACT_COUNT)


def requests(traffic: Traffic) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(arrival s, input_len, output_len)` of the stream, float64 arrays of
    `traffic.num_requests`; arrivals start at 0 (the first request) and are sorted."""
    rng = np.random.default_rng(traffic.seed)
    n = traffic.num_requests
    if math.isinf(traffic.rate) or traffic.concurrency > 0:
        arrival = np.zeros(n)
    else:
        gaps = rng.exponential(1.0 / traffic.rate, n)
        arrival = np.cumsum(gaps) - gaps[0]
    inp = _lengths(rng, traffic.input_len, traffic.input_spread, traffic.distribution, n)
    out = _lengths(rng, traffic.output_len, traffic.output_spread, traffic.distribution, n)
    return arrival, inp, out


def read_trace(path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A trace CSV with columns `arrival` (s), `input_len`, `output_len` (tokens), one request
    per row, as `(arrival, input_len, output_len)` sorted by arrival; errors name the row."""
    import pandas as pd
    try:
        table = pd.read_csv(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"trace {path}: cannot read it as CSV ({err})") from None
    missing = [c for c in ("arrival", "input_len", "output_len") if c not in table.columns]
    if missing:
        raise ValueError(f"trace {path}: missing column(s) {', '.join(missing)} "
                         "(needs arrival, input_len, output_len)")
    if len(table) == 0:
        raise ValueError(f"trace {path}: no requests")
    cols = {}
    for c in ("arrival", "input_len", "output_len"):
        v = pd.to_numeric(table[c], errors="coerce").to_numpy(float)
        bad = ~np.isfinite(v) | (v < (0 if c == "arrival" else 1))
        if c != "arrival":
            bad |= (v != np.round(v)) | (v > MAX_EXACT_COUNT)
        if bad.any():
            row = int(np.argmax(bad))
            raise ValueError(f"trace {path}: row {row + 2}: {c} must be "
                             + ("a time >= 0 s" if c == "arrival" else "a whole number >= 1")
                             + f", got {str(table[c].iloc[row])!r}")
        cols[c] = v
    order = np.argsort(cols["arrival"], kind="stable")
    arrival = cols["arrival"][order]
    return arrival - arrival[0], cols["input_len"][order], cols["output_len"][order]
