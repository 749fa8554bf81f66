"""The two primitives every phase is built from: collectives (NCCL-style rings on a two-tier
network, the NVLink part in NCCL's protocol by message size) and the roofline (smooth max,
straight-through ceilings, kernel times).

Expected values are the textbook formulas written out by hand.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import diffperf as dp
from diffperf.costs import (
    SHARPNESS,
    ceil_div,
    exposed_after_overlap,
    gemm_time,
    op_time,
    smooth_max,
)
from diffperf.internal import collectives as coll

# A hand-made network with round numbers so every term is visible.
NET = dp.Network(nvlink_domain=8, nvlink_bandwidth=300e9, nvlink_latency=2e-6,
                 scaleout_bandwidth=25e9, scaleout_latency=5e-6)
EFF = dp.Efficiency(nvlink=0.8, all_to_all=0.6, scaleout=0.85, collective_overhead=10e-6)
BW_IN = 300e9 * 0.8
BW_OUT = 25e9 * 0.85
OVH = 10e-6
SIZE = 1e9  # 1 GB message


def close(a, b, rtol=1e-5):
    np.testing.assert_allclose(float(a), float(b), rtol=rtol)


# NCCL's protocols on an NVLink ring, from its tuning model (`src/graph/tuning.cc`, NCCL 2.18 to
# 2.29): ring base latency LL 6.6, LL128 14.0, Simple 8.4 us; NVLink hop LL 0.6, LL128 1.9,
# Simple 3.4 us; bandwidth LL 0.5 (8 B of data per 16 B line), LL128 0.92 (120 of 128 B),
# Simple 1.0 of the ring's bus bandwidth. LL's base latency and hop are the model's fitted call
# overhead (OVH) and hop (NET's 2 us), so LL128 and Simple add NCCL's differences to them:
#   LL      k h                        + D / (0.5 B)
#   LL128   7.4 us + k (h + 1.3 us)    + D / (0.92 B)
#   Simple  1.8 us + k (h + 2.8 us)    + D / B     (with NVLS: latency min(that, 23 us))
# for D bus bytes per GPU in k ring steps. The ring takes their smooth minimum
# (sum_p t_p^-32)^(-1/32) (p = 32, the module's sharpness).
HOP = 2e-6
SIMPLE_HOP = HOP + (3.4 - 0.6) * 1e-6  # 4.8 us
SIMPLE_BASE = (8.4 - 6.6) * 1e-6       # 1.8 us


def ring_protocols(bus_bytes, steps, hop=HOP, bw=BW_IN, nvls=False):
    """(LL, LL128, Simple-or-NVLS) times of an NVLink ring, s, by hand from the table above."""
    ll = steps * hop + bus_bytes / (0.5 * bw)
    ll128 = (14.0 - 6.6) * 1e-6 + steps * (hop + (1.9 - 0.6) * 1e-6) + bus_bytes / (0.92 * bw)
    simple_latency = (8.4 - 6.6) * 1e-6 + steps * (hop + (3.4 - 0.6) * 1e-6)
    if nvls:
        simple_latency = min(simple_latency, 23e-6)  # NCCL's NVLS latency
    return ll, ll128, simple_latency + bus_bytes / bw


def smooth_min_by_hand(times):
    """(sum_i t_i^-32)^(-1/32) in float64."""
    t = np.asarray(times, dtype=np.float64)
    return float(np.sum(t ** -32.0) ** (-1.0 / 32.0))


# At 1 GB every ring here is bandwidth-bound: Simple is fastest and LL128 stays at least 1.08x
# slower (its 1/0.92 = 1.087x bandwidth penalty, less or more its latency difference: 1.081x for
# the 12- and 14-step 16-rank all-gathers, up to 1.089x for 2 ranks), LL 1.97-2.0x. The smooth
# minimum then sits at most 1 - (1 + 1.08^-32 + 1.9^-32)^(-1/32) = 1 - (1 + 0.0852)^(-1/32) =
# 0.26 % below Simple's time (0.20-0.25 % in these cases), never above it.
BELOW_SIMPLE = 1.0 - (1.0 + 1.08 ** -32 + 1.9 ** -32) ** (-1.0 / 32.0)  # 2.55e-3


def assert_simple_wins(got, simple):
    """`got` (the NVLink part) is Simple's time less at most the smooth minimum's BELOW_SIMPLE."""
    assert simple * (1.0 - BELOW_SIMPLE) <= float(got) <= simple * (1.0 + 1e-6), (got, simple)


# --------------------------------------------------------------------------------------------
# 3. Collectives
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_reduce_inside_one_nvlink_domain(n):
    """2 (n - 1)/n x size bus bytes in 2 (n - 1) ring steps. At 1 GB NCCL picks Simple: full
    bandwidth, 1.8 us base and 2 (n - 1) hops of 4.8 us (the alpha-beta ring before protocols
    paid 2 us hops and no base here); the smooth minimum keeps it within BELOW_SIMPLE of that.
    A 16 B message picks LL, far from a tie (LL128 >= 1.6x slower): exactly the alpha-beta ring
    at half the bandwidth, 2 (n - 1) hops of 2 us."""
    bus, steps = 2 * (n - 1) / n * SIZE, 2 * (n - 1)
    cands = ring_protocols(bus, steps)
    got = coll.all_reduce(NET, EFF, SIZE, n, 1)
    close(got, smooth_min_by_hand(cands) + OVH)
    simple = SIMPLE_BASE + steps * SIMPLE_HOP + bus / BW_IN
    assert cands[2] == pytest.approx(simple, rel=1e-12)
    assert_simple_wins(float(got) - OVH, simple)
    tiny = 16.0
    close(coll.all_reduce(NET, EFF, tiny, n, 1),
          steps * 2e-6 + 2 * (n - 1) / n * tiny / (0.5 * BW_IN) + OVH)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_gather_and_reduce_scatter_inside_one_domain(n):
    """(n - 1)/n x size bus bytes in n - 1 ring steps: Simple at 1 GB (1.8 us + (n - 1) hops of
    4.8 us + the bytes at full bandwidth, within BELOW_SIMPLE), LL's (n - 1) 2 us hops at 16 B."""
    bus, steps = (n - 1) / n * SIZE, n - 1
    want = smooth_min_by_hand(ring_protocols(bus, steps)) + OVH
    close(coll.all_gather(NET, EFF, SIZE, n, 1), want)
    close(coll.reduce_scatter(NET, EFF, SIZE, n, 1), want)
    assert_simple_wins(float(coll.all_gather(NET, EFF, SIZE, n, 1)) - OVH,
                       SIMPLE_BASE + steps * SIMPLE_HOP + bus / BW_IN)
    tiny = 16.0
    close(coll.all_gather(NET, EFF, tiny, n, 1),
          steps * 2e-6 + (n - 1) / n * tiny / (0.5 * BW_IN) + OVH)


@pytest.mark.parametrize("n,stride", [(8, 1), (16, 2), (64, 8), (4, 16)])
def test_all_reduce_is_reduce_scatter_plus_all_gather(n, stride):
    """A ring all-reduce moves the bytes of a reduce-scatter followed by an all-gather (one call
    overhead). Across domains the all-reduce pays hierarchical latency (2 (n_in - 1) NVLink and
    2 (n_out - 1) fabric hops), while NCCL's all-gather / reduce-scatter are flat rings of n - 1
    steps, n_out - 1 of them across the fabric and n - n_out over NVLink (NCCL's ring latency
    model): the pair pays 2 (n - n_out - n_in + 1) more NVLink hops. With protocols (1 GB:
    Simple on NVLink) those are Simple's 4.8 us hops, and the pair also pays a second protocol
    base latency (1.8 us) besides the second call overhead; the relation holds exactly per
    protocol, so the model's values differ from it only by the smooth minimum (each side at most
    BELOW_SIMPLE of its NVLink part below Simple). Groups without NVLink steps (n_in = 1) are
    alpha-beta rings on the fabric: exact."""
    ar = coll.all_reduce(NET, EFF, SIZE, n, stride)
    rs_ag = coll.reduce_scatter(NET, EFF, SIZE, n, stride) + coll.all_gather(NET, EFF, SIZE, n,
                                                                              stride)
    n_in = min(8 / stride, n) if stride < 8 else 1
    n_out = n / n_in
    if n_in == 1:
        close(ar, rs_ag - OVH)
        return
    lat_gap = SIMPLE_BASE + 2 * (n - n_out - n_in + 1) * SIMPLE_HOP
    ar_nvlink_simple = (SIMPLE_BASE + 2 * (n_in - 1) * SIMPLE_HOP
                        + 2 * (n_in - 1) / n_in * SIZE / BW_IN)
    np.testing.assert_allclose(float(ar), float(rs_ag) - OVH - lat_gap, rtol=0,
                               atol=BELOW_SIMPLE * ar_nvlink_simple)
    # and each side exactly, by hand
    fabric_ar = 2 * (n_out - 1) / n_out * SIZE / n_in / BW_OUT + 2 * (n_out - 1) * 5e-6
    fabric_ag = (n_out - 1) / n_out * SIZE / n_in / BW_OUT + (n_out - 1) * 5e-6
    close(ar, smooth_min_by_hand(ring_protocols(2 * (n_in - 1) / n_in * SIZE, 2 * (n_in - 1)))
          + fabric_ar + OVH)
    close(rs_ag, 2 * (smooth_min_by_hand(ring_protocols((n_in - 1) / n_in * SIZE, n - n_out))
                      + fabric_ag + OVH))


@pytest.mark.parametrize("n,stride", [(4, 8), (16, 8), (8, 16), (2, 64)])
def test_group_with_stride_at_least_the_domain_uses_scaleout(n, stride):
    """Every member sits in a different NVLink domain: a flat ring over the scale-out NICs."""
    want = 2 * (n - 1) / n * SIZE / BW_OUT + 2 * (n - 1) * 5e-6 + OVH
    close(coll.all_reduce(NET, EFF, SIZE, n, stride), want)
    want_ag = (n - 1) / n * SIZE / BW_OUT + (n - 1) * 5e-6 + OVH
    close(coll.all_gather(NET, EFF, SIZE, n, stride), want_ag)


def test_all_gather_across_domains_is_a_flat_ring_in_latency():
    """16 ranks over two 8-GPU domains: hierarchical bytes (7/8 of the data over NVLink, half of
    an eighth over each NIC) and a flat ring's 15 steps of latency (NCCL has no all-gather
    tree): a chunk crosses the fabric once (5 us) and NVLink 14 times, those 14 steps in the
    protocol NCCL picks: at 1 GB Simple (1.8 us + 14 hops of 4.8 us; the alpha-beta ring before
    protocols paid 14 x 2 us), the smooth minimum within BELOW_SIMPLE of it."""
    nvlink = smooth_min_by_hand(ring_protocols(7 / 8 * SIZE, 14))
    want = nvlink + 1 / 2 * SIZE / 8 / BW_OUT + 5e-6 + OVH
    close(coll.all_gather(NET, EFF, SIZE, 16, 1), want)
    close(coll.reduce_scatter(NET, EFF, SIZE, 16, 1), want)
    assert_simple_wins(nvlink, SIMPLE_BASE + 14 * SIMPLE_HOP + 7 / 8 * SIZE / BW_IN)


def test_hierarchical_split():
    """16 ranks at stride 2 with 8-GPU domains: 4 per domain over 4 domains."""
    n_in, n_out = coll.tier_split(NET, 16, 2)
    assert float(n_in) == 4 and float(n_out) == 4
    n_in, n_out = coll.tier_split(NET, 64, 1)
    assert float(n_in) == 8 and float(n_out) == 8
    n_in, n_out = coll.tier_split(NET, 4, 1)  # a small group inside one domain
    assert float(n_in) == 4 and float(n_out) == 1
    n_in, n_out = coll.tier_split(NET, 4, 8)
    assert float(n_in) == 1 and float(n_out) == 4
    # hierarchical all-reduce: RS + AG in-domain on the full message (2 x 3/4 of it in 6 NVLink
    # steps, Simple at 1 GB), AR across domains on 1/n_in (6 fabric hops, alpha-beta)
    nvlink = smooth_min_by_hand(ring_protocols(2 * 3 / 4 * SIZE, 2 * 3))
    want = nvlink + 2 * 3 / 4 * (SIZE / 4) / BW_OUT + 2 * 3 * 5e-6 + OVH
    close(coll.all_reduce(NET, EFF, SIZE, 16, 2), want)
    assert_simple_wins(nvlink, SIMPLE_BASE + 6 * SIMPLE_HOP + 2 * 3 / 4 * SIZE / BW_IN)


def test_group_of_one_costs_nothing():
    for f in (coll.all_reduce, coll.all_gather, coll.reduce_scatter, coll.all_to_all):
        assert float(f(NET, EFF, SIZE, 1, 1)) == 0.0


def test_all_to_all_by_hand():
    # 16 ranks, stride 1: 8 per domain. Each rank keeps 1/16, sends 7/16 over NVLink and 8/16
    # out, at the same time: the NIC part (8/16 at 25 GB/s) is the slower.
    n = 16
    want = SIZE * 8 / n / BW_OUT + 7 * 2e-6 + 1 * 5e-6 + OVH
    close(coll.all_to_all(NET, EFF, SIZE, n, 1), want)
    # all in one domain: NVLink only, at the all-to-all fraction of the link (not the rings')
    close(coll.all_to_all(NET, EFF, SIZE, 8, 1), SIZE * 7 / 8 / (300e9 * 0.6) + 7 * 2e-6 + OVH)


@pytest.mark.parametrize("span,tier", [(2, "in"), (4, "in"), (8, "in"), (9, "out"), (16, "out"),
                                       (64, "out")])
def test_send_recv_picks_the_right_tier(span, tier):
    """A chain of ranks stays on NVLink only if it fits in one 8-GPU domain."""
    bw, lat = (BW_IN, 2e-6) if tier == "in" else (BW_OUT, 5e-6)
    close(coll.send_recv(NET, EFF, SIZE, span), SIZE / bw + lat + OVH)


def test_scaleout_is_slower_than_nvlink_for_the_same_group_size():
    assert float(coll.all_reduce(NET, EFF, SIZE, 8, 8)) > 5 * float(
        coll.all_reduce(NET, EFF, SIZE, 8, 1))


def test_all_reduce_time_grows_with_group_size():
    """Ring all-reduce per-rank traffic 2(n-1)/n S grows with n, across the tier boundary too."""
    times = [float(coll.all_reduce(NET, EFF, SIZE, n, 1)) for n in (2, 4, 8, 16, 32, 64, 128)]
    assert all(b > a for a, b in zip(times, times[1:])), times


# --------------------------------------------------------------------------------------------
# 4. Roofline
# --------------------------------------------------------------------------------------------

times = st.floats(min_value=1e-9, max_value=1e3, allow_nan=False, allow_infinity=False)


@settings(max_examples=25, deadline=None)
@given(a=times, b=times)
def test_smooth_max_bounds_and_symmetry(a, b):
    m = max(a, b)
    s_ab = float(smooth_max(jnp.float32(a), jnp.float32(b)))
    s_ba = float(smooth_max(jnp.float32(b), jnp.float32(a)))
    assert s_ab == s_ba
    assert s_ab >= m * (1 - 1e-6)
    assert s_ab <= m * (1 + SHARPNESS) * (1 + 1e-6)


@settings(max_examples=25, deadline=None)
@given(total=times, a=times, b=times)
def test_exposed_after_overlap_bounded_and_monotone(total, a, b):
    lo, hi = sorted((a, b))
    e_lo = float(exposed_after_overlap(jnp.float32(total), jnp.float32(lo)))
    e_hi = float(exposed_after_overlap(jnp.float32(total), jnp.float32(hi)))
    assert 0.0 <= e_hi <= e_lo * (1 + 1e-6) + 1e-30  # a longer window never exposes more
    assert e_lo <= total * (1 + 1e-6)
    # never less than the hard clip(total - window, 0, total)
    assert e_lo >= max(total - lo, 0.0) * (1 - 1e-5)


@pytest.mark.parametrize("window", [0.5, 3.0, 30.0, 3e3])
def test_exposed_after_overlap_is_accurate_in_float32(window):
    """A well-hidden transfer leaves a tiny exposed tail; float32 must get it to 1e-5 (the
    direct (x + sqrt(x^2 + c^2)) / 2 loses it to cancellation), as vmap == loop requires."""
    total, k = 1.0, SHARPNESS
    x = total - window
    want = min(0.5 * (x + np.sqrt(x * x + (k * total) ** 2)), total)  # float64 reference
    got = float(exposed_after_overlap(jnp.float32(total), jnp.float32(window)))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_exposed_after_overlap_limits():
    # no window: the whole transfer is exposed (within the smoothing)
    close(exposed_after_overlap(jnp.float32(2.0), jnp.float32(0.0)), 2.0, rtol=SHARPNESS**2)
    # a window 100x longer hides all but a tiny fraction of the transfer
    assert float(exposed_after_overlap(jnp.float32(1.0), jnp.float32(100.0))) < 1e-4


def test_smooth_max_at_a_tie_and_far_from_it():
    close(smooth_max(jnp.float32(2.0), jnp.float32(2.0)), 2.0 * (1 + SHARPNESS))
    # far from a tie the excess is O(SHARPNESS^2) of the larger term
    x = float(smooth_max(jnp.float32(1.0), jnp.float32(1e-3)))
    assert 1.0 <= x <= 1.0 + SHARPNESS**2


def test_gemm_knee_by_hand(a100):
    """GEMMs use the softer knee GEMM_SHARPNESS = 0.3: a GEMM whose compute and HBM times tie
    takes 1.3x either (plus one kernel's fixed cost); other ops keep the 0.1 knee."""
    from diffperf.costs import GEMM_SHARPNESS
    assert GEMM_SHARPNESS == 0.3
    close(smooth_max(jnp.float32(2.0), jnp.float32(2.0), 0.3), 2.6)
    eff = dp.Efficiency(kernel_overhead=0.0, matmul_size_scale=1e-6, l2=1.0)
    m, n, k = 64.0, 8192.0, 8192.0  # bf16; HBM bytes = 2 (m k + k n + m n)
    flops, nbytes = 2 * m * n * k, 2 * (m * k + k * n + m * n)
    t_hbm = nbytes / (2.039e12 * float(eff.hbm))
    # choose matmul_peak so that compute exactly ties with HBM (64 rows: no tile padding)
    peak = flops / t_hbm / 312e12
    eff = dp.Efficiency(kernel_overhead=0.0, matmul_size_scale=1e-6, matmul_peak=peak, l2=1.0)
    got = float(gemm_time(a100, eff, m, n, k, 1)) - 3e-6  # minus the A100 launch overhead
    # (the L2 stream, ~10x shorter, adds its own 0.1-knee smoothing of about 0.3 %)
    np.testing.assert_allclose(got, 1.3 * t_hbm, rtol=6e-3)
    assert got > 1.3 * t_hbm


def test_smooth_max_gradient_goes_to_the_binding_resource():
    ga, gb = jax.grad(lambda a, b: smooth_max(a, b), argnums=(0, 1))(10.0, 1.0)
    assert float(ga) > 0.9 and 0.0 <= float(gb) < 0.1


@pytest.mark.parametrize("a,b", [(0.2, 1.0), (1.0, 1.0), (2.3, 1.0), (127.9, 16.0), (128.0, 16.0),
                                 (128.01, 16.0), (21.0, 7.0), (360.0, 120.0)])
def test_ceil_div_forward_is_ceil_gradient_is_the_quotients(a, b):
    assert float(ceil_div(jnp.float32(a), jnp.float32(b))) == np.ceil(np.float32(a) / np.float32(b))
    ga, gb = jax.grad(ceil_div, argnums=(0, 1))(jnp.float32(a), jnp.float32(b))
    np.testing.assert_allclose([float(ga), float(gb)], [1.0 / b, -a / b**2], rtol=1e-6)


@pytest.mark.parametrize("sms", [7.0, 56.0, 108.0, 120.0, 132.0, 148.0])
def test_ceil_div_exact_by_a_constant_divisor_under_vmap(sms):
    """XLA turns a division by a constant into a product with its rounded reciprocal, which puts
    e.g. 360 / 120 above 3 (np.ceil would then count 4 waves of 120 SMs for 360 tiles);
    `ceil_div` must match integer arithmetic on every numerator."""
    tiles = np.arange(0, 20001, dtype=np.float32)
    got = np.asarray(jax.jit(jax.vmap(lambda x: ceil_div(x, jnp.float32(sms))))(tiles))
    np.testing.assert_array_equal(got, -(-tiles.astype(np.int64) // int(sms)))


@pytest.fixture(scope="module")
def a100():
    return dp.gpu("a100-sxm4-80gb")


def test_pure_memory_op_time(a100):
    """A kernel with no arithmetic streams its bytes at the sustained HBM bandwidth."""
    eff = dp.Efficiency(hbm=0.85, kernel_overhead=2e-6)
    nbytes = 4e9
    t_mem = nbytes / (2.039e12 * 0.85)
    ovh = 3e-6 + 2e-6  # A100 launch + kernel tail
    got = float(op_time(a100, eff, 0.0, nbytes))
    # equal to bytes / (bw * eff) + overhead up to the documented smooth-max excess O(k^2)
    assert t_mem + ovh <= got * (1 + 1e-6)
    np.testing.assert_allclose(got, t_mem + ovh, rtol=SHARPNESS**2)
    # with three kernels the overhead triples
    got3 = float(op_time(a100, eff, 0.0, nbytes, kernels=3.0))
    np.testing.assert_allclose(got3 - got, 2 * ovh, rtol=1e-3)


def test_big_gemm_is_compute_bound(a100):
    """16k^3 bf16 GEMM: time ~ 2 m n k / (peak * matmul_efficiency), far above its HBM time."""
    eff = dp.Efficiency()
    m = n = k = 16384
    c = float(eff.matmul_size_scale)
    e_mm = float(eff.matmul_peak) / (1 + c / m + c / n + c / k)  # documented functional form
    t_compute = 2.0 * m * n * k / (312e12 * e_mm)
    t_hbm = 3 * m * n * 2 / (2.039e12 * float(eff.hbm))
    got = float(gemm_time(a100, eff, m, n, k, 1))
    assert t_compute > 20 * t_hbm
    # the GEMM knee k = 0.3 adds (1 + sqrt(1 + k^2)) / 2 - 1 = 2.2 % far from the ridge
    np.testing.assert_allclose(got, t_compute * (1 + (1 + 0.3**2) ** 0.5) / 2, rtol=0.03)
    # and never faster than the peak allows
    assert got >= 2.0 * m * n * k / 312e12


def test_one_row_gemm_is_memory_bound(a100):
    """A (1 x 8192) @ (8192 x 8192) bf16 GEMM (a GEMV, as in batch-1 decode) streams 134 MB of
    weights and does only 134 MFLOP: arithmetic intensity 1 FLOP/B, far below the A100's
    ridge point (~150 FLOP/B). Its time must be set by HBM bandwidth, within a small factor."""
    eff = dp.Efficiency()
    k = n = 8192
    weight_bytes = k * n * 2
    t_hbm = (weight_bytes + 2 * k * 2) / (2.039e12 * float(eff.hbm))
    got = float(gemm_time(a100, eff, 1, n, k, 1))
    assert got >= t_hbm
    assert got <= 2.0 * t_hbm + 10e-6, (got, t_hbm)


def test_gemm_time_scales_linearly_with_batch_when_large(a100):
    eff = dp.Efficiency()
    one = float(gemm_time(a100, eff, 4096, 4096, 4096, 1, batch=8.0))
    two = float(gemm_time(a100, eff, 4096, 4096, 4096, 1, batch=16.0))
    np.testing.assert_allclose(two / one, 2.0, rtol=0.02)


def test_unsupported_precision_gives_finite_time(a100):
    t = float(gemm_time(a100, dp.Efficiency(), 4096, 4096, 4096, 2))  # fp8 on an A100
    assert np.isfinite(t) and t > 1.0


def test_nvlink_sharp_caps_small_all_reduce_latency_at_nccl_nvls_latency():
    """In-switch reduction (NVLS): with NVLink SHARP an in-domain all-reduce may take NCCL's flat
    23 us NVLS latency in Simple's place (at the ring's bandwidth either way). A 16 B message is
    latency-bound, and its fastest candidates are LL's 2 (n - 1) hops of 2 us (the alpha-beta
    ring before protocols) and NVLS: LL wins up to 6 GPUs (20 us) and NVLS from 7 (24 us > 23
    us), as before protocols. The smooth minimum sits at most 2^(-1/32) = 0.979 of the fastest
    (a two-way tie; at 7 GPUs, 23 against 24 us, it gives 22.84 us); the exact value is the
    p-norm by hand. Without NVLink SHARP, LL (>= 2.6x faster than LL128 and Simple) is exact."""
    sharp = eqx.tree_at(lambda n: n.nvlink_sharp, NET, jnp.float32(1.0))
    tiny = 16.0  # bytes: latency-bound
    for n, fastest in ((2, 4e-6), (4, 12e-6), (6, 20e-6), (7, 23e-6), (8, 23e-6)):
        bus, steps = 2 * (n - 1) / n * tiny, 2 * (n - 1)
        ring = float(coll.all_reduce(NET, EFF, tiny, n, 1))
        nvls = float(coll.all_reduce(sharp, EFF, tiny, n, 1))
        close(ring, steps * 2e-6 + bus / (0.5 * BW_IN) + OVH)
        cands = ring_protocols(bus, steps, nvls=True)
        close(nvls, smooth_min_by_hand(cands) + OVH)
        assert min(cands) == pytest.approx(fastest, abs=1e-9)  # which candidate wins, by hand
        assert 2 ** (-1 / 32) * min(cands) * (1 - 1e-6) <= nvls - OVH <= min(cands) * (1 + 1e-6)
    # a 72-GPU domain (NVL72) at NCCL's 0.6 us LL hop: LL 85.2 us, so NVLS's 23 us (far from
    # a tie: exact)
    nvl72 = eqx.tree_at(lambda n: (n.nvlink_domain, n.nvlink_latency), sharp,
                        (jnp.float32(72.0), jnp.float32(0.6e-6)))
    close(float(coll.all_reduce(nvl72, EFF, tiny, 72, 1)), 2 * 71 / 72 * tiny / BW_IN + 23e-6 + OVH)
    # large messages: identical bandwidth term, so the Simple candidates differ by the latency
    # alone: 1.8 us + 14 x 4.8 us = 69 us against NVLS's 23 us, 46 us. The smooth minimum takes
    # a little of it back (LL128, 8.4 % slower than Simple, 9.1 % slower than NVLS, pulls the
    # ring's time further down): 42.9 us by hand.
    big = 1e9
    bus = 2 * 7 / 8 * big
    diff = (float(coll.all_reduce(NET, EFF, big, 8, 1))
            - float(coll.all_reduce(sharp, EFF, big, 8, 1)))
    want = (smooth_min_by_hand(ring_protocols(bus, 14))
            - smooth_min_by_hand(ring_protocols(bus, 14, nvls=True)))
    assert (SIMPLE_BASE + 14 * SIMPLE_HOP) - 23e-6 == pytest.approx(46e-6, rel=1e-9)
    close(diff, want, rtol=1e-3)
    assert 0 < diff < 46e-6


def test_nvlink_sharp_must_be_a_flag():
    with pytest.raises(ValueError, match="nvlink_sharp"):
        dp.Network(nvlink_domain=8, nvlink_bandwidth=1e11, nvlink_latency=1e-6,
                   scaleout_bandwidth=1e10, scaleout_latency=1e-6, nvlink_sharp=2)
