"""Collective communication on the two-tier network (NCCL-style rings, protocol by size).

A communication group is `n` ranks spaced `stride` apart in Megatron's rank order (tensor
parallel innermost, then context, data, and pipeline parallel outermost). With NVLink domains of
D consecutive ranks, `n_in = clip(D / stride, 1, n)` members of the group share a domain and the
group spans `n_out = n / n_in` domains. Collectives are hierarchical: a ring inside each domain
over NVLink and a ring across domains over the scale-out fabric, each GPU using its own NIC.

Inside the NVLink domain the ring runs in whichever of NCCL's three protocols is fastest for the
message (`_nvlink_ring`): LL (small messages: lowest latency, half the bandwidth), LL128
(medium: 92 % of the bandwidth, more latency) and Simple (large: full bandwidth, most latency
per step), with NCCL's own latencies and bandwidth fractions. The scale-out tier keeps the
alpha-beta ring (Simple's latency and bandwidth).

All sizes are the full (unsharded) message `size` in bytes; all times in seconds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..specs._efficiency import Efficiency
from ..specs._hardware import Network


def tier_split(net: Network, n, stride) -> tuple[jax.Array, jax.Array]:
    """Members of an `n`-rank group per NVLink domain (`n_in`) and domains spanned (`n_out`)."""
    n = jnp.asarray(n, dtype=jnp.result_type(float))
    n_in = jnp.clip(net.nvlink_domain / stride, 1.0, n)
    return n_in, n / n_in


def _bw(net: Network, eff: Efficiency, nvlink_fraction=None):
    """Achieved (NVLink, scale-out) bandwidth, B/s: NVLink at `eff.nvlink` (rings) unless
    `nvlink_fraction` is given."""
    f = eff.nvlink if nvlink_fraction is None else nvlink_fraction
    return net.nvlink_bandwidth * f, net.scaleout_bandwidth * eff.scaleout


def _fixed(n, eff: Efficiency):
    """Software overhead of one collective call; zero for a group of one."""
    return jnp.where(n > 1, eff.collective_overhead, 0.0)


#: Latency of an NVLS (NVLink SHARP, in-switch) all-reduce inside one NVLink domain, s: NCCL's
#: tuning model (`src/graph/tuning.cc`: NVLS base latency 23 us in NCCL 2.18; in current NCCL
#: hwLat NVLINK / NVLS / Simple = 25 us with base latency 0).
NVLS_LATENCY = 23e-6

#: NCCL's protocols on an NVLink ring, as its tuning model (`src/graph/tuning.cc`, NCCL 2.18 to
#: 2.29) has them: (extra base latency over LL, s; extra latency per ring step over LL's hop, s;
#: fraction of the Simple protocol's bus bandwidth). Base latencies of a ring: LL 6.6, LL128 14.0,
#: Simple 8.4 us; NVLink hop latencies: LL 0.6, LL128 1.9, Simple 3.4 us; bandwidth: LL moves 8 B
#: of data per 16 B line (`busBw * .5`), LL128 120 of every 128 B (`busBw * 0.92` in the code).
#: The LL base latency and hop are those of the model without protocols (`Efficiency.
#: collective_overhead`, `Network.nvlink_latency`, both fitted to end-to-end data), so only the
#: differences are added here: for tiny messages the model is unchanged.
PROTOCOLS = {
    "LL": (0.0, 0.0, 0.5),
    "LL128": (14.0e-6 - 6.6e-6, 1.9e-6 - 0.6e-6, 0.92),
    "Simple": (8.4e-6 - 6.6e-6, 3.4e-6 - 0.6e-6, 1.0),
}

#: Sharpness of the smooth minimum over protocols (`smooth_min`): the p of a p-norm of
#: reciprocals. At a two-way tie the result is 2^(-1/p) = 0.979 of either term; for large
#: messages, where LL128 stays 1/0.92 = 1.087x slower than Simple, it is 0.2 % below Simple's
#: (p = 12 would give 2.6 %, a bias at every size).
PROTOCOL_SHARPNESS = 32.0


def smooth_min(times: jax.Array, p: float = PROTOCOL_SHARPNESS) -> jax.Array:
    """Smooth minimum of positive times along the last axis, s: `(sum_i t_i^-p)^(-1/p)`.

    Never above the minimum: k^(-1/p) of it at a k-way tie (0.979 for two, 0.966 for three at
    p = 32), the minimum itself far from ties; gradients go to the near-fastest terms. Computed as
    `m (sum_i (t_i / m)^-p)^(-1/p)` with m the exact minimum held constant (the expression is
    homogeneous of degree one, so value and gradient are unchanged) to stay inside float32.
    Every time must be > 0."""
    return smooth_min_of([times[..., i] for i in range(times.shape[-1])], p)


def smooth_min_of(times: list, p: float = PROTOCOL_SHARPNESS) -> jax.Array:
    """`smooth_min` of the same-shaped arrays `times` (elementwise; no stacked axis, so XLA
    fuses it with its inputs: a stacked version made a training sweep about 5x slower).

    At p = 32 it is computed in multiplies and square roots (an integer power; the 32nd root
    as five square roots), with each ratio m / t_i floored at 1/4: a term below 0.25^32 =
    5e-20 against the fastest term's 1 changes nothing, and no power reaches float32's
    subnormal range."""
    m = jax.lax.stop_gradient(functools.reduce(jnp.minimum, times))
    # A zero time (a zero-byte message on zero-latency links) makes the minimum 0: return it,
    # with safe operands (no 0 / 0) everywhere.
    positive = m > 0
    m = jnp.where(positive, m, 1.0)
    times = [jnp.where(positive, t, 1.0) for t in times]
    if p == 32.0:
        total = sum(jnp.maximum(m / t, 0.25) ** 32 for t in times)
        root = total
        for _ in range(5):
            root = jnp.sqrt(root)
        return jnp.where(positive, m / root, 0.0)
    return jnp.where(positive, m * sum((t / m) ** (-p) for t in times) ** (-1.0 / p), 0.0)


def _nvlink_ring(net: Network, eff: Efficiency, bus_bytes, steps, nvls=False) -> jax.Array:
    """Time of the NVLink part of a ring collective, s, in the protocol NCCL would pick.

    `bus_bytes` B cross each GPU's NVLink (2 (n - 1)/n x size for an all-reduce, (n - 1)/n x size
    for an all-gather or reduce-scatter) in `steps` ring steps. With B = nvlink_bandwidth x
    eff.nvlink and h = nvlink_latency, protocol p (`PROTOCOLS`: extra base latency a_p, extra
    hop latency d_p, bandwidth fraction f_p; a = d = 0, f = 0.5 for LL) takes

        t_p = a_p + steps (h + d_p) + bus_bytes / (f_p B)

    and the ring takes their smooth minimum (`smooth_min`), as NCCL's tuner picks the fastest.
    With `nvls` (an all-reduce on NVLink SHARP switches) NVLS, at full bandwidth like Simple,
    takes Simple's place when faster: that candidate's latency is min(Simple's, NVLS_LATENCY)
    (the ring's bandwidth is kept for NVLS; two candidates with one bandwidth term would tie at
    every large size). Zero when `steps` is 0 (no NVLink step)."""
    bw = net.nvlink_bandwidth * eff.nvlink
    hop = net.nvlink_latency
    active = steps > 0
    cands = []
    for name, (base, extra_hop, frac) in PROTOCOLS.items():
        latency = base + steps * (hop + extra_hop)
        if nvls and name == "Simple":
            latency = jnp.where(net.nvlink_sharp > 0, jnp.minimum(latency, NVLS_LATENCY),
                                latency)
        cands.append(latency + bus_bytes / (frac * bw))
    safe = [jnp.where(active, c, 1.0) for c in cands]  # safe operands without NVLink
    return jnp.where(active, smooth_min_of(safe), 0.0)


def _ring_latency(net: Network, n, n_out):
    """Latency of a pipelined ring of `n` ranks over `n_out` domains (n - 1 steps): a chunk
    crosses the fabric n_out - 1 times and NVLink on the other steps (NCCL's ring latency
    model, `src/graph/tuning.cc`)."""
    return (n_out - 1.0) * net.scaleout_latency + (n - n_out) * net.nvlink_latency


def all_reduce(net: Network, eff: Efficiency, size, n, stride=1.0) -> jax.Array:
    """Hierarchical ring all-reduce of `size` bytes over `n` ranks: reduce-scatter in-domain,
    all-reduce across domains on 1/n_in of the data, all-gather in-domain.

    In-domain: `_nvlink_ring` with 2 (n_in - 1)/n_in x size bus bytes in 2 (n_in - 1) steps
    (NVLS a candidate with NVLink SHARP); across domains: 2 (n_out - 1)/n_out x size / n_in at
    the scale-out bandwidth plus 2 (n_out - 1) scale-out hops; plus the fixed call overhead."""
    n_in, n_out = tier_split(net, n, stride)
    _, bw_out = _bw(net, eff)
    t_in = _nvlink_ring(net, eff, 2 * (n_in - 1) / n_in * size, 2 * (n_in - 1), nvls=True)
    t_out = (2 * (n_out - 1) / n_out * size / n_in / bw_out
             + 2 * (n_out - 1) * net.scaleout_latency)
    return t_in + t_out + _fixed(n, eff)


def all_gather(net: Network, eff: Efficiency, size, n, stride=1.0, striped=1.0) -> jax.Array:
    """Ring all-gather producing `size` bytes on every rank (each holds size/n). NCCL's flat
    ring over all n ranks: its n - n_out NVLink steps carry (n_in - 1)/n_in x size per GPU in
    the protocol NCCL picks (`_nvlink_ring`), its n_out - 1 fabric steps (n_out - 1)/n_out x
    size / n_in through each GPU's NIC (each domain's NICs carry 1/n_in of the data each) at
    the scale-out latency per step. NCCL has no tree for all-gather / reduce-scatter.

    `striped = 0` models a flat ring that does not stripe over a domain's NICs: once the group
    leaves the NVLink domain every rank's (n - 1)/n of the data crosses its own NIC (DeepSpeed's
    2021 ZeRO-3 gathers; see `benchmarks_data/SOURCES.md`), with the alpha-beta ring latency."""
    n = jnp.asarray(n, dtype=jnp.result_type(float))
    n_in, n_out = tier_split(net, n, stride)
    bw_in, bw_out = _bw(net, eff)
    t_in = _nvlink_ring(net, eff, (n_in - 1) / n_in * size, n - n_out)
    t_striped = (t_in + (n_out - 1) / n_out * size / n_in / bw_out
                 + (n_out - 1.0) * net.scaleout_latency)
    flat = ((n - 1.0) / n * size / jnp.where(n_out > 1, bw_out, bw_in)
            + _ring_latency(net, n, n_out))
    return jnp.where(striped > 0, t_striped, flat) + _fixed(n, eff)


def reduce_scatter(net: Network, eff: Efficiency, size, n, stride=1.0, striped=1.0) -> jax.Array:
    """Hierarchical ring reduce-scatter of `size` bytes (each rank ends with size/n reduced);
    the mirror image of `all_gather`, same cost."""
    return all_gather(net, eff, size, n, stride, striped)


def all_to_all(net: Network, eff: Efficiency, size, n, stride=1.0) -> jax.Array:
    """All-to-all where each rank holds `size` bytes and keeps 1/n of it: the in-domain share
    (n_in - 1)/n goes over NVLink, the rest (n - n_in)/n over the scale-out fabric. The two
    run at the same time (NCCL issues every peer's send and receive in one group, over
    NVLink and over the NIC), so the slower sets the time."""
    n = jnp.asarray(n, dtype=jnp.result_type(float))
    n_in, n_out = tier_split(net, n, stride)
    bw_in, bw_out = _bw(net, eff, eff.all_to_all)  # every peer at once, not a ring
    t = (jnp.maximum(size * (n_in - 1) / n / bw_in, size * (n - n_in) / n / bw_out)
         + (n_in - 1) * net.nvlink_latency + (n_out - 1) * net.scaleout_latency)
    return t + _fixed(n, eff)


def send_recv(net: Network, eff: Efficiency, size, span) -> jax.Array:
    """Point-to-point transfer of `size` bytes along a chain of ranks covering `span` consecutive
    ranks (e.g. a pipeline: pp stages spaced tp*cp*dp apart span tp*cp*dp*pp ranks). NVLink when
    the whole chain fits in one domain, else the slowest hop crosses the scale-out fabric."""
    bw_in, bw_out = _bw(net, eff)
    intra = span <= net.nvlink_domain
    bw = jnp.where(intra, bw_in, bw_out)
    lat = jnp.where(intra, net.nvlink_latency, net.scaleout_latency)
    return size / bw + lat + eff.collective_overhead
