"""Collective communication on the two-tier network (alpha-beta model, NCCL-style rings).

A communication group is `n` ranks spaced `stride` apart in Megatron's rank order (tensor
parallel innermost, then context, data, and pipeline parallel outermost). With NVLink domains of
D consecutive ranks, `n_in = clip(D / stride, 1, n)` members of the group share a domain and the
group spans `n_out = n / n_in` domains. Collectives are hierarchical: a ring inside each domain
over NVLink and a ring across domains over the scale-out fabric, each GPU using its own NIC.

All sizes are the full (unsharded) message `size` in bytes; all times in seconds.
"""

from __future__ import annotations

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
#: tuning model (`src/graph/tuning.cc`, hwLat NVLINK / NVLS / Simple = 23 us, base latency 0).
NVLS_LATENCY = 23e-6


def _in_domain_all_reduce_latency(net: Network, n_in):
    """Latency of the in-domain part of an all-reduce over `n_in` GPUs, s: a ring's 2 (n_in - 1)
    hops, or with in-switch reduction (NVLink SHARP) whichever of the ring and NVLS is faster,
    as NCCL's tuner picks. At NCCL's 0.6 us LL hop an 8-GPU ring (8.4 us) beats NVLS; a 72-GPU
    NVL72 group (85 us) does not."""
    ring = 2.0 * (n_in - 1.0) * net.nvlink_latency
    nvls = jnp.where(n_in > 1, NVLS_LATENCY, 0.0)
    return jnp.where(net.nvlink_sharp > 0, jnp.minimum(ring, nvls), ring)


def _ring_latency(net: Network, n, n_out):
    """Latency of a pipelined ring of `n` ranks over `n_out` domains (n - 1 steps): a chunk
    crosses the fabric n_out - 1 times and NVLink on the other steps (NCCL's ring latency
    model, `src/graph/tuning.cc`)."""
    return (n_out - 1.0) * net.scaleout_latency + (n - n_out) * net.nvlink_latency


def all_reduce(net: Network, eff: Efficiency, size, n, stride=1.0) -> jax.Array:
    """Hierarchical ring all-reduce of `size` bytes over `n` ranks: reduce-scatter in-domain,
    all-reduce across domains on 1/n_in of the data, all-gather in-domain. With NVLink SHARP
    the in-domain latency is at most NVLS's (the bandwidth term is kept at the ring's)."""
    n_in, n_out = tier_split(net, n, stride)
    bw_in, bw_out = _bw(net, eff)
    t_in = (2 * (n_in - 1) / n_in * size / bw_in
            + _in_domain_all_reduce_latency(net, n_in))
    t_out = (2 * (n_out - 1) / n_out * size / n_in / bw_out
             + 2 * (n_out - 1) * net.scaleout_latency)
    return t_in + t_out + _fixed(n, eff)


def all_gather(net: Network, eff: Efficiency, size, n, stride=1.0, striped=1.0) -> jax.Array:
    """Ring all-gather producing `size` bytes on every rank (each holds size/n). Bandwidth as
    the hierarchical ring (each domain's NICs carry 1/n_in of the data each); latency of NCCL's
    flat ring over all n ranks (`_ring_latency`): NCCL has no tree for all-gather /
    reduce-scatter.

    `striped = 0` models a flat ring that does not stripe over a domain's NICs: once the group
    leaves the NVLink domain every rank's (n - 1)/n of the data crosses its own NIC (DeepSpeed's
    2021 ZeRO-3 gathers; see `benchmarks_data/SOURCES.md`)."""
    n_in, n_out = tier_split(net, n, stride)
    bw_in, bw_out = _bw(net, eff)
    t_bw = (n_in - 1) / n_in * size / bw_in + (n_out - 1) / n_out * size / n_in / bw_out
    flat = (n - 1.0) / n * size / jnp.where(n_out > 1, bw_out, bw_in)
    return jnp.where(striped > 0, t_bw, flat) + _ring_latency(net, n, n_out) + _fixed(n, eff)


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
