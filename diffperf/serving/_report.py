"""What a serving benchmark reports, from the simulated per-request times: latency
percentiles, throughput, goodput under SLOs, cost per million tokens, energy per token."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ._simulate import Schedule


def masked_percentile(x, mask, q) -> jax.Array:
    """The `q`-th percentile (0-100) of `x` over the entries where `mask` holds, with linear
    interpolation between order statistics (numpy's default); 0 where no entry holds."""
    k = jnp.sum(mask)
    s = jnp.sort(jnp.where(mask, x, jnp.inf))
    last = jnp.maximum(k - 1, 0)
    pos = q / 100.0 * last.astype(s.dtype)
    lo = jnp.floor(pos).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, last)
    v_lo, v_hi = s[lo], s[hi]
    gap = jnp.where(jnp.isfinite(v_hi - v_lo), v_hi - v_lo, 0.0)
    v = v_lo + (pos - lo.astype(s.dtype)) * gap
    return jnp.where(k > 0, v, 0.0)


def binned_percentile(count, total, q) -> jax.Array:
    """The `q`-th percentile (0-100) of values counted in bins: `count` values per bin
    summing to `total` (same unit as the values) per bin; the mean of the bin where the
    cumulative count first reaches q % of all (exact when that bin holds one distinct value,
    else within the bin's width); 0 when nothing was counted."""
    cum = jnp.cumsum(count)
    all_ = cum[-1]
    b = jnp.argmax(cum >= q / 100.0 * all_ * (1.0 - 1e-6))
    return jnp.where(all_ > 0, total[b] / jnp.maximum(count[b], 1e-30), 0.0)


class Latency(eqx.Module):
    """Mean and percentiles of one latency over the requests, s."""

    mean: jax.Array
    p50: jax.Array
    p90: jax.Array
    p99: jax.Array


def _latency(x, mask) -> Latency:
    k = jnp.maximum(jnp.sum(mask), 1).astype(x.dtype)
    return Latency(mean=jnp.sum(jnp.where(mask, x, 0.0)) / k,
                   p50=masked_percentile(x, mask, 50.0), p90=masked_percentile(x, mask, 90.0),
                   p99=masked_percentile(x, mask, 99.0))


class ServingReport(eqx.Module):
    """One deployment under one traffic. Times s, throughputs per s, cost USD, energy J.

    `ttft`: time to first token; `tpot`: per request (finish - first token) / (output - 1),
    over the requests with more than one output token; `itl`: the inter-token gaps of every
    request pooled, as `vllm bench serve` and SGLang's `bench_serving` report them: mean sum
    of (finish - first token) / sum of (output - 1), percentiles from the simulation's gap
    bins (`Schedule.gap_count`, 12 % wide): a prompt chunk that stalls the decoders makes a
    few long gaps, which move TPOT's mean and the tail but not the median gap; `e2e`:
    end-to-end latency; `queue`: arrival to admission. `output_tok_s`: output tokens / (last
    finish - first arrival), all replicas; `per_gpu`: divided by every GPU of the deployment.
    """

    ttft: Latency
    tpot: Latency
    itl: Latency
    e2e: Latency
    queue: Latency
    output_tok_s: jax.Array
    output_tok_s_per_gpu: jax.Array
    total_tok_s: jax.Array  # input + output tokens / duration, all replicas
    request_rate: jax.Array  # completed requests / duration, all replicas
    duration: jax.Array  # last finish - first arrival of the simulated replica
    busy_share: jax.Array  # share of the duration the engine was iterating
    mean_batch_tokens: jax.Array  # mean tokens per iteration
    iterations: jax.Array
    kv_capacity: jax.Array  # KV-cache tokens of one replica
    kv_peak_share: jax.Array  # most KV the running contexts filled / kv_capacity: above 1
    #                           the engine would have preempted (not modelled; happens only
    #                           with Engine.kv_output_reserve < 1)
    replicas: jax.Array
    num_gpus: jax.Array
    cost_per_million_tokens: jax.Array  # USD per 10^6 output tokens (0 without a price)
    energy_per_token: jax.Array  # J per output token (0 without a power model)
    completed: jax.Array  # 1 if every request finished within the step bound
    goodput: jax.Array  # requests/s (all replicas) whose TTFT and TPOT both meet the per-request
    #                     targets given to `report` (every request when none is given)
    slo_attainment: jax.Array  # share of the requests that meet them, 0-1
    ttft_growth: jax.Array  # mean TTFT of the last quarter of the requests (by arrival) minus
    #                         that of the first quarter, s: large when the offered load
    #                         exceeds what the deployment sustains (the backlog grows)

    @property
    def itl_mean(self) -> jax.Array:
        """Mean inter-token latency, s (`itl.mean`)."""
        return self.itl.mean


def report(schedule: Schedule, input_len, output_len, kv_capacity, replicas, gpus_per_replica,
           price_per_hour=0.0, power_idle=0.0, power_max=0.0, ttft_target=jnp.inf,
           tpot_target=jnp.inf) -> ServingReport:
    """Summarise one replica's `schedule` (its requests' `input_len` / `output_len`) for a
    deployment of `replicas` alike replicas of `gpus_per_replica` GPUs each.

    Energy: each GPU draws `power_idle` W plus (`power_max` - `power_idle`) x the share of
    the time the engine iterates (a linear utilisation model, the one most serving-cost
    studies use); J per output token = power x GPUs x duration / output tokens.

    Goodput (DistServe's definition): the requests per second whose own TTFT <= `ttft_target`
    and own TPOT <= `tpot_target` (s; a request with one output token has no TPOT to miss)."""
    s = schedule
    out = jnp.asarray(output_len, s.finish.dtype)
    inp = jnp.asarray(input_len, s.finish.dtype)
    everyone = jnp.ones(out.shape, bool)
    decoded = out > 1
    start = jnp.min(s.arrival)
    duration = jnp.maximum(jnp.max(s.finish) - start, 1e-12)
    tpot = (s.e2e - s.ttft) / jnp.maximum(out - 1.0, 1.0)
    steps = jnp.sum(jnp.where(decoded, out - 1.0, 0.0))
    itl = jnp.where(steps > 0, jnp.sum(jnp.where(decoded, s.e2e - s.ttft, 0.0))
                    / jnp.maximum(steps, 1.0), 0.0)
    tokens = jnp.sum(out)
    tok_s = replicas * tokens / duration
    gpus = replicas * gpus_per_replica
    busy = jnp.clip(s.busy_time / duration, 0.0, 1.0)
    power = power_idle + (power_max - power_idle) * busy
    meets = (s.ttft <= ttft_target) & ((tpot <= tpot_target) | ~decoded)
    return ServingReport(
        ttft=_latency(s.ttft, everyone), tpot=_latency(tpot, decoded),
        itl=Latency(mean=itl, p50=binned_percentile(s.gap_count, s.gap_sum, 50.0),
                    p90=binned_percentile(s.gap_count, s.gap_sum, 90.0),
                    p99=binned_percentile(s.gap_count, s.gap_sum, 99.0)),
        e2e=_latency(s.e2e, everyone),
        queue=_latency(s.queue, everyone), output_tok_s=tok_s,
        output_tok_s_per_gpu=tok_s / gpus,
        total_tok_s=replicas * (tokens + jnp.sum(inp)) / duration,
        request_rate=replicas * out.shape[0] / duration, duration=duration, busy_share=busy,
        mean_batch_tokens=s.mean_tokens, iterations=s.iterations,
        kv_capacity=jnp.asarray(kv_capacity, s.finish.dtype),
        kv_peak_share=s.kv_peak / jnp.maximum(jnp.asarray(kv_capacity, s.finish.dtype), 1.0),
        replicas=replicas + 0.0 * busy,
        num_gpus=gpus + 0.0 * busy,
        cost_per_million_tokens=price_per_hour * gpus / 3600.0 / tok_s * 1e6,
        energy_per_token=power * gpus / tok_s, completed=s.completed,
        goodput=replicas * jnp.sum(meets.astype(duration.dtype)) / duration,
        slo_attainment=jnp.mean(meets.astype(duration.dtype)),
        ttft_growth=_ttft_growth(s))


def _ttft_growth(s: Schedule) -> jax.Array:
    """Mean TTFT of the last quarter of the requests by arrival minus that of the first
    quarter, s."""
    order = jnp.argsort(s.arrival)
    queue = s.ttft[order]
    n = queue.shape[0]
    q = max(n // 4, 1)
    return jnp.mean(queue[n - q:]) - jnp.mean(queue[:q])
