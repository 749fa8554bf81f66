"""An engine replica's scheduler, simulated iteration by iteration in JAX.

The rules are those of docs/serving.md ("Scheduler semantics"): first-come-first-served
admission into `max_num_seqs` request slots while the KV cache holds what each request holds
(`held`: its whole context reserved, or its current context plus a share of its remaining
output, `Engine.kv_output_reserve`), a token budget per iteration shared by decode tokens and
prompt chunks under a decode-first or prefill-first policy, and each iteration's time from
`diffperf.inference.iteration_time`. `diffperf.serving.reference_schedule` is the same
scheduler in plain Python; the tests check that both give the same admissions and times.

**State.** Admission and prefill are both in request order, so two pointers describe them:
`p`, the next request to admit, and `q`, the first admitted request whose prompt is not yet
complete, with `done` of its tokens prefilled (every admitted request after `q` has none:
chunks are given in request order, so at most the first pending prompt is part-done). The
running requests sit in `slots` fixed-size slots (request index, tokens generated). A step
costs O(slots) work; the per-request arrays (arrival, admission, first token, finish) are
written by scatters of at most `slots` entries.

**Fast-forward.** When an iteration schedules no prompt tokens (none is pending, or the
pending ones do not fit the budget the decoders leave), the engine runs decode-only
iterations with a fixed set of decoders until a request finishes (freeing budget and a slot)
or a waiting request can be admitted. One
simulation step covers all k of them: with n decoders the keys read grow by n per
iteration, so iteration j takes T_j = T_0 + j (T_1 - T_0) where the iteration time is affine
in the keys (no sliding window, the host hidden); k is the smallest count whose summed time
reaches the next admissible arrival, or the fewest tokens any decoder still has to make, and
the k iterations take k (T_0 + T_{k-1}) / 2. Exact where T is affine in the keys (then the
per-request times equal those of the iteration-by-iteration loop to float rounding); with a
sliding window (keys grow more slowly) or a binding host, the sum of T_j is the trapezoid of
its first and last terms. `fast_forward=False` runs every iteration.

Simulation steps: one per iteration with prompt tokens, one per fast-forwarded stretch, one
per idle gap; at most about 4 N + (prompt tokens) / budget for N requests (`step_bound`).

**Inter-token gaps.** What `vllm bench serve` and SGLang's `bench_serving` call ITL is every
gap between two tokens of a request, pooled over all requests; its median is a typical
iteration, while TPOT's mean also carries the long gaps of iterations that prefill other
prompts. The gaps are counted in `GAP_BINS` log-spaced bins (`gap_bin`), with their summed
length per bin, so that a percentile is the mean of the bin it falls in (`binned_percentile`,
within the bin's 12 % width). Per step at most five entries: the scheduled decoders that
emitted at the end of the last step wait one iteration, t0; the others (left out while prompts
went first, prefill-first) their wait plus t0, in two entries: those waiting longer than their
mean and the rest, each at its mean (one entry at the mean of all missed the tail when
closed-loop arrivals spread the waits); a fast-forwarded stretch's k - 1 further iterations as
two halves of (k - 1) d / 2 gaps each at their means (T_j is linear in j). The reference's gaps
(`ReferenceResult.inter_token_gaps`) give the same count and sum, and percentiles within a bin
(tests/test_serving_simulate.py).

**Closed loop.** The requests issued when others finish arrive just after that step's end
clock, the k-th at k x `CLOSED_LOOP_GAP` (1 us) after it: a client sends its next request only
once its last token has reached it, when a busy engine has started its next iteration (the
request joins the one after), and clients do not send at the same instant (an idle engine
starts on the first request; the others join its next iteration). Its arrival is written at
the start of the next step from the clock that step carries, not at the end of the step that
computed the clock: there XLA could recompute the clock inside the scatter's fusion, and that
copy could round differently (by a fraction of an ulp in the low word), so that the request's
offset from the clock, and with it the iteration it joins, depended on how the program was
compiled (vmapped batch size, surrounding code).

**Loop.** The `lax.while_loop` tests its condition (requests left, steps below `max_steps`)
once per `STEP_BLOCK` steps, run as a fixed-length inner loop: a step taken when the condition
is false changes nothing (every update is masked by it), so the results are those of testing
after every step. Vmapped over deployments, a while loop's condition is per deployment and
each test merges the new state into the old with a select, which copies the per-request
arrays (N entries each, per deployment); with a block of steps that copy is paid once per
block instead of once per step.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..inference._iteration import IterationCost, iteration_base, keys_read, time_with_keys
from ..specs._engine import Engine
from ._reference import CLOSED_LOOP_GAP

_BIG = 1e30  # "never" (a time or a count); finite so that no NaN is ever produced
#: Simulation steps between two tests of the loop's condition (module docstring, "Loop").
STEP_BLOCK = 16
#: Most request slots whose prefix sums are taken as a matmul (`_prefix_sum`); above, cumsum.
PREFIX_MATMUL_SLOTS = 128
#: Inter-token gaps are counted in log-spaced bins (`Schedule.gap_count`): GAP_BINS bins of
#: 1 / GAP_BINS_PER_DECADE decade each from GAP_LOW s (12 % wide; gaps outside go to the end
#: bins, whose sums still hold their exact seconds).
GAP_BINS = 160
GAP_BINS_PER_DECADE = 20
GAP_LOW = 1e-5


class Requests(eqx.Module):
    """The request stream of one replica: `arrival` s (sorted; ignored in a closed loop),
    `input_len` and `output_len` tokens (>= 1), arrays of N. `arrival_lo` (optional, s): the
    part of each arrival time below `arrival`'s float32 resolution (`split_times`), so that a
    stream of hours keeps sub-millisecond latencies."""

    arrival: jax.Array
    input_len: jax.Array
    output_len: jax.Array
    arrival_lo: jax.Array | None = None


def split_times(t) -> tuple:
    """float64 times as `(hi, lo)` float32 arrays with hi + lo = t to about 1e-14 relative."""
    t = np.asarray(t, np.float64)
    hi = t.astype(np.float32)
    return hi, (t - hi.astype(np.float64)).astype(np.float32)


class Schedule(eqx.Module):
    """Per-request times of a simulation, s (arrays of N), and its bookkeeping. `admit`,
    `first_token` and `finish` are absolute float32 times; `queue`, `ttft` and `e2e` the same
    events measured from each request's arrival, kept exact over long streams (the clock is a
    float32 pair, see `simulate`)."""

    arrival: jax.Array  # as issued (a closed loop sets them as requests finish)
    admit: jax.Array
    first_token: jax.Array
    finish: jax.Array
    queue: jax.Array  # admit - arrival
    ttft: jax.Array  # first_token - arrival
    e2e: jax.Array  # finish - arrival
    completed: jax.Array  # 1 if every request finished within the step bound
    steps: jax.Array  # simulation steps used
    iterations: jax.Array  # engine iterations simulated
    busy_time: jax.Array  # time the engine spent iterating (not idle), s
    mean_tokens: jax.Array  # mean tokens per iteration
    kv_peak: jax.Array  # most KV tokens the running requests' contexts filled at once
    gap_count: jax.Array  # inter-token gaps (all requests) per log-spaced bin (`gap_bin`)
    gap_sum: jax.Array  # their summed length per bin, s (gap_sum / gap_count: the bin's mean)


def gap_bin(gap) -> jax.Array:
    """The bin of an inter-token gap of `gap` s: floor(GAP_BINS_PER_DECADE log10(gap /
    GAP_LOW)), clipped to 0 .. GAP_BINS - 1 (int32)."""
    g = jnp.maximum(gap, GAP_LOW * 1e-3)
    b = jnp.floor(GAP_BINS_PER_DECADE * jnp.log10(g / GAP_LOW))
    return jnp.clip(b, 0, GAP_BINS - 1).astype(jnp.int32)


def reservation(engine: Engine, input_len, output_len) -> jax.Array:
    """KV-cache tokens of a request's whole context rounded up to blocks, ceil((input +
    output) / block) block, tokens: what it holds from admission on when the engine reserves
    (`Engine.kv_output_reserve` = 1), and what the cache must hold for it ever to run."""
    return jnp.ceil((input_len + output_len) / engine.block_size) * engine.block_size


def held(engine: Engine, input_len, generated, output_len) -> jax.Array:
    """KV-cache tokens a running (or admitted) request counts against admissions, tokens:
    ceil((I + g + r (O - g)) / block) block with g = max(generated, 1) (admission allocates the
    prompt and its first token) and r = `Engine.kv_output_reserve` (1: the whole context,
    `reservation`; 0: the current context, blocks allocated as it grows)."""
    g = jnp.maximum(generated, 1.0)
    need = input_len + g + engine.kv_output_reserve * (output_len - g)
    return jnp.ceil(need / engine.block_size) * engine.block_size


def context_blocks(engine: Engine, input_len, generated) -> jax.Array:
    """KV-cache tokens a request's context fills, rounded up to blocks: ceil((I + max(g, 1)) /
    block) block (`Schedule.kv_peak` sums them over the running requests)."""
    return jnp.ceil((input_len + jnp.maximum(generated, 1.0)) / engine.block_size) \
        * engine.block_size


def step_bound(input_len, engine: Engine) -> int:
    """A bound on the simulation steps for these prompts (concrete values): 4 N + the
    prompts' chunks + 16, a chunk getting at least the budget the decoders leave,
    max(B - S, 1) tokens (B the token budget, S the request slots; a prompt whose remaining
    tokens do not fit waits in a fast-forwarded stretch)."""
    n = int(np.size(input_len))
    budget = float(np.min(np.asarray(engine.max_num_batched_tokens)))
    seqs = float(np.max(np.asarray(engine.max_num_seqs)))
    chunk = max(budget - seqs, 1.0)
    return int(4 * n + np.sum(np.ceil(np.asarray(input_len, float) / chunk)) + 16)


def _base(cost, tokens, emitting, has_decode, pairs, has_prefill):
    """An iteration's time without its decoders' key reads (`iteration_base`)."""
    return iteration_base(cost, tokens, emitting, has_decode, pairs, has_prefill)


def _with_keys(cost, base, keys):
    """The iteration's time when its decoders read `keys` keys (`time_with_keys`), s."""
    return time_with_keys(cost, *base, keys)


def _affine_root(t0, delta, gap) -> jax.Array:
    """Smallest whole k >= 1 with k t0 + delta k (k - 1) / 2 >= gap (t0 > 0, delta >= 0)."""
    a = t0 - 0.5 * delta
    root = 2.0 * gap / (a + jnp.sqrt(jnp.maximum(a * a + 2.0 * delta * gap, 0.0)))
    return jnp.maximum(jnp.ceil(root), 1.0)


def _prefix_sum(x) -> jax.Array:
    """Inclusive prefix sums of `x` along its last axis (the request slots). Up to
    `PREFIX_MATMUL_SLOTS` slots as the product with a triangular matrix of ones: one small
    matmul where XLA's CPU cumsum (a reduce-window) costs several times more, and a step takes
    three; above, where the matmul's O(slots^2) work dominates, `jnp.cumsum`. The terms summed
    here are whole token counts (or 0 / 1), so every order of summation gives the same sums
    (exact below 2^24 in float32); after a `_BIG` term every sum exceeds any KV capacity,
    whatever the order."""
    k = x.shape[-1]
    if k > PREFIX_MATMUL_SLOTS:
        return jnp.cumsum(x, axis=-1)
    upper = (jnp.arange(k)[:, None] <= jnp.arange(k)[None, :]).astype(x.dtype)
    return jnp.matmul(x, upper, precision=jax.lax.Precision.HIGHEST)


def _leading(mask) -> jax.Array:
    """How many entries at the start of the boolean vector `mask` are true before the first
    false one (int32; sum(cumprod(mask)) without a scan)."""
    k = mask.shape[-1]
    return jnp.min(jnp.where(mask, k, jnp.arange(k, dtype=jnp.int32)))


def simulate(cost: IterationCost, engine: Engine, kv_capacity, requests: Requests,
             slots: int, max_steps: int, concurrency=0.0, fast_forward: bool = True,
             differentiable: bool = False, prefilled: bool = False) -> Schedule:
    """Simulate one engine replica serving `requests` (module docstring).

    **Arguments:**

    - `cost`: the deployment's iteration-time coefficients (`diffperf.inference.iteration_cost`).
    - `engine`: scheduler settings; `engine.max_num_seqs` <= `slots`.
    - `kv_capacity`: KV-cache tokens of the replica.
    - `requests`: the request stream (N requests).
    - `slots`: static size of the slot arrays (>= every vmapped `max_num_seqs`).
    - `max_steps`: static bound on simulation steps (`step_bound`); `completed` says whether
      it sufficed.
    - `concurrency`: 0 for the open loop (arrivals as given), else C clients in a closed loop.
    - `fast_forward`: cover decode-only stretches in one step (module docstring).
    - `prefilled`: the requests arrive with their prompt already in the KV cache and their
      first token out (the decode pool of disaggregated serving): admitted, each decodes its
      remaining `output_len - 1` tokens; `first_token` is then the admission time.
    - `differentiable`: run all `max_steps` steps as a `lax.scan` (reverse-mode gradients);
      by default a `lax.while_loop` stops when every request has finished (forward-mode
      derivatives only).

    Pure JAX: vmap over deployments (cost, engine, kv_capacity, concurrency) or streams.

    The clock is a pair of float32 numbers (hi + lo, compensated summation), and every event is
    recorded relative to its request's arrival, so latencies keep their precision however long
    the stream (a float32 clock alone has 2 ms steps after 4.5 hours).
    """
    n = requests.arrival.shape[0]
    fin = lambda x: jnp.asarray(x, jnp.result_type(float))
    s_in, s_out = fin(requests.input_len), fin(requests.output_len)
    closed = fin(concurrency) > 0
    open_loop = isinstance(concurrency, (int, float)) and concurrency == 0
    order = jnp.arange(n, dtype=jnp.int32)
    arrival0 = jnp.where(closed, jnp.where(fin(order) < concurrency, 0.0, _BIG),
                         fin(requests.arrival))
    lo0 = (jnp.zeros((n,), arrival0.dtype) if requests.arrival_lo is None
           else jnp.where(closed, 0.0, fin(requests.arrival_lo)))
    admit_need = held(engine, s_in, 0.0, s_out)
    window = jnp.arange(slots, dtype=jnp.int32)
    usable = fin(window) < engine.max_num_seqs
    budget = engine.max_num_batched_tokens
    decode_first = engine.policy == 0
    zeros = jnp.zeros((n,), fin(0).dtype)

    def gather(a, idx):
        return a[jnp.clip(idx, 0, n - 1)]

    def issue(arrival, arrival_lo, start, stop, hi, lo):
        """Closed loop: requests `start` to `stop - 1` (at most `slots`) arrive at (hi, lo)
        plus 1, 2, ... x `CLOSED_LOOP_GAP` (module docstring, "Closed loop")."""
        at = jnp.where(start + window < stop, start + window, n)
        return arrival.at[at].set(hi, mode="drop"), arrival_lo.at[at].set(
            lo + CLOSED_LOOP_GAP * (1.0 + window.astype(lo.dtype)), mode="drop")

    def step(state):
        (t, t_lo, p, q, done, kv_used, kv_peak, issue_from, issued, n_done, steps, iters, busy,
         tok_sum, slot_req, slot_gen, arrival, arrival_lo, admit, first, finish, slot_last,
         slot_last_lo, gap_count, gap_sum) = state
        active = (n_done < n) & (steps < max_steps)  # else the step changes nothing
        # 0. closed loop: the requests the last step's finishes issued arrive at its end, the
        # clock now, written from the clock this step reads (module docstring, "Closed loop")
        if not open_loop:  # (a static open loop skips the two scatters: 11 % of a step)
            arrival, arrival_lo = issue(arrival, arrival_lo, issue_from, issued, t, t_lo)

        def since(idx, hi=t, lo=t_lo):  # clock minus the arrival of request idx, s
            return (hi - gather(arrival, idx)) + (lo - gather(arrival_lo, idx))
        # 1. admission, first come first served with head-of-line blocking
        running = slot_req >= 0
        free = engine.max_num_seqs - fin(jnp.sum(running))
        idx = p + window
        valid = idx < n
        arr_w = jnp.where(valid, gather(arrival, idx), _BIG)
        res_w = jnp.where(valid, gather(admit_need, idx), _BIG)
        ok = (fin(window) < free) & valid & (arr_w < _BIG) & (since(idx) >= 0) & (
            kv_used + _prefix_sum(res_w) <= kv_capacity)
        m = jnp.where(active, _leading(ok), 0)
        is_free = (~running) & usable
        rank = _prefix_sum(fin(is_free)).astype(jnp.int32) - 1
        newly = is_free & (rank < m)
        slot_req = jnp.where(newly, p + rank, slot_req)
        slot_gen = jnp.where(newly, 1.0 if prefilled else 0.0, slot_gen)
        slot_last = jnp.where(newly, t, slot_last)  # (a prefilled request's first token)
        slot_last_lo = jnp.where(newly, t_lo, slot_last_lo)
        admit = admit.at[jnp.where(window < m, idx, n)].set(since(idx), mode="drop")
        if prefilled:
            first = first.at[jnp.where(window < m, idx, n)].set(since(idx), mode="drop")
        kv_used = kv_used + jnp.sum(jnp.where(window < m, res_w, 0.0))
        p = p + m
        if prefilled:
            q = p
        running = slot_req >= 0
        # 2. idle: nothing running, wait for the next arrival
        idle = active & ~jnp.any(running)
        later = since(p) < 0  # the next arrival is ahead of the clock
        go = active & ~idle
        # 3. schedule: decoders (prompt complete) and prompt chunks in request order
        decoder = running & (slot_req < q)
        n_dec = fin(jnp.sum(decoder))
        pending_any = q < p
        dec_on = decoder & (decode_first | ~pending_any)
        d = fin(jnp.sum(dec_on))
        b = jnp.where(decode_first, budget - n_dec, budget)
        idx2 = q + window
        pending = idx2 < p
        prompt = gather(s_in, idx2)
        before_done = jnp.where(window == 0, done, 0.0)
        rem = jnp.where(pending, prompt - before_done, 0.0)
        cum = _prefix_sum(rem)
        chunk = jnp.where(engine.chunked_prefill > 0, jnp.clip(b - (cum - rem), 0.0, rem),
                          jnp.where(cum <= b, rem, 0.0))
        completes = pending & (rem > 0) & (chunk >= rem)
        n_c = _leading(completes)
        pre_tokens = jnp.sum(chunk)
        # sum(chunk (before_done + chunk / 2)); only slot 0 has tokens before (`done`). Written
        # so, XLA:CPU's reduction fusion runs 16 % faster a step than the fused multiply-add
        pairs = 0.5 * jnp.sum(chunk * chunk) + chunk[0] * done
        has_prefill = (pre_tokens > 0).astype(t.dtype)
        in_slot = gather(s_in, slot_req)
        ctx = jnp.where(running, in_slot + slot_gen, 0.0)
        keys0 = jnp.sum(jnp.where(dec_on, keys_read(cost, ctx), 0.0))
        keys1 = jnp.sum(jnp.where(dec_on, keys_read(cost, ctx + 1.0), 0.0))
        tokens = d + pre_tokens
        emitting = d + fin(n_c)
        # Engine.context_pass: the prompt tokens (each completed prompt's last one excepted)
        # run in a pass of their own, then the decode pass takes the decoders and the prompts
        # just completed (their last token, reading their prompt's keys); else one mixed pass
        sep = engine.context_pass > 0
        ctx_tokens = pre_tokens - fin(n_c)
        first_keys = jnp.sum(jnp.where(window < n_c, keys_read(cost, prompt), 0.0))
        base = _base(cost, jnp.where(sep, emitting, tokens), emitting,
                     jnp.where(sep, emitting > 0, d > 0), jnp.where(sep, 0.0, pairs),
                     jnp.where(sep, 0.0, has_prefill))
        ctx_time = jnp.where(sep & (ctx_tokens > 0), _with_keys(
            cost, _base(cost, jnp.maximum(ctx_tokens, 1.0), 0.0, False, pairs, 1.0), 0.0), 0.0)
        t0 = _with_keys(cost, base, keys0 + jnp.where(sep, first_keys, 0.0))
        t0 = jnp.where(sep & (emitting == 0) & (ctx_tokens > 0), 0.0, t0) + ctx_time
        # 4. fast-forward a decode-only stretch
        out_slot = gather(s_out, slot_req)
        left = jnp.where(dec_on, out_slot - slot_gen, _BIG)
        k_finish = jnp.min(left)
        head_res = gather(admit_need, p)
        can_admit = (p < n) & (free - fin(m) > 0) & (kv_used + head_res <= kv_capacity)
        t1 = _with_keys(cost, base, keys1)
        gap = -since(p)
        k_arrive = jnp.where(can_admit & (gap > 0),
                             _affine_root(t0, jnp.maximum(t1 - t0, 0.0), gap), _BIG)
        ff = fast_forward & (has_prefill == 0) & (d > 0)
        k = jnp.where(ff, jnp.maximum(jnp.minimum(k_finish, k_arrive), 1.0), 1.0)
        keys_last = jnp.sum(jnp.where(dec_on, keys_read(cost, ctx + k - 1.0), 0.0))
        t_last = _with_keys(cost, base, keys_last)
        span = jnp.where(k > 1, 0.5 * k * (t0 + t_last), t0)
        # compensated sum (t, t_lo) + span: hi carries the float32 value, lo its rounding error
        s_hi = t + span
        bb = s_hi - t
        err = (t - (s_hi - bb)) + (span - bb)
        s_lo = t_lo + err
        hi2 = s_hi + s_lo
        lo2 = s_lo - (hi2 - s_hi)
        jump = idle & later
        t_new = jnp.where(go, hi2, jnp.where(jump, gather(arrival, p), t))
        t_lo_new = jnp.where(go, lo2, jnp.where(jump, gather(arrival_lo, p), t_lo))
        since_new = lambda idx: since(idx, t_new, t_lo_new)
        # inter-token gaps (module docstring, "Inter-token gaps"): each scheduled decoder's
        # first one, from its last token to the end of this step's first iteration (t0 for
        # those that emitted at the end of the last step; the others' mean), then a stretch's
        # k - 1 iterations as two halves at their means (T_j linear in j)
        rec = go & dec_on
        fresh = rec & (slot_last == t) & (slot_last_lo == t_lo)
        stale = rec & ~fresh
        n_fresh, n_stale = fin(jnp.sum(fresh)), fin(jnp.sum(stale))
        waited = (t - slot_last) + (t_lo - slot_last_lo)  # per slot
        mean_wait = jnp.sum(jnp.where(stale, waited, 0.0)) / jnp.maximum(n_stale, 1.0)
        longer = stale & (waited > mean_wait)  # the stale split at their mean wait
        n_long = fin(jnp.sum(longer))
        long_wait = jnp.sum(jnp.where(longer, waited, 0.0)) / jnp.maximum(n_long, 1.0)
        short_wait = (jnp.sum(jnp.where(stale & ~longer, waited, 0.0))
                      / jnp.maximum(n_stale - n_long, 1.0))
        k1 = jnp.maximum(k - 1.0, 1.0)
        rest = (span - t0) / k1
        half = 0.25 * (t_last - t0) * (k - 2.0) / k1
        more = jnp.where(go & (k > 1), 0.5 * d * (k - 1.0), 0.0)
        gaps = jnp.stack([t0, t0 + short_wait, t0 + long_wait, rest - half, rest + half])
        weight = jnp.stack([n_fresh, n_stale - n_long, n_long, more, more])
        gaps = jnp.where(weight > 0, gaps, GAP_LOW)
        bins = gap_bin(gaps)
        gap_count = gap_count.at[bins].add(weight)
        gap_sum = gap_sum.at[bins].add(weight * gaps)
        # 5. updates
        slot_gen = jnp.where(go & dec_on, slot_gen + k, slot_gen)
        got_first = go & running & (slot_req >= q) & (slot_req < q + n_c)
        slot_gen = jnp.where(got_first, 1.0, slot_gen)
        first = first.at[jnp.where(got_first, slot_req, n)].set(since_new(slot_req),
                                                                 mode="drop")
        emitted = go & (dec_on | got_first)
        slot_last = jnp.where(emitted, t_new, slot_last)
        slot_last_lo = jnp.where(emitted, t_lo_new, slot_last_lo)
        new_q = jnp.where(go, q + n_c, q)
        done = jnp.where(go, jnp.where(n_c == 0, done + chunk[0],
                                       jnp.take(chunk, jnp.minimum(n_c, slots - 1))), done)
        done = jnp.where(new_q >= p, 0.0, done)
        ends = go & running & (slot_gen >= out_slot)
        finish = finish.at[jnp.where(ends, slot_req, n)].set(since_new(slot_req), mode="drop")
        filled = jnp.sum(jnp.where(running, context_blocks(engine, in_slot, slot_gen), 0.0))
        kv_peak = jnp.maximum(kv_peak, jnp.where(go, filled, 0.0))
        # what the requests still running hold (their contexts grew when r < 1)
        kv_used = jnp.sum(jnp.where(running & ~ends,
                                    held(engine, in_slot, slot_gen, out_slot), 0.0))
        slot_req = jnp.where(ends, -1, slot_req)
        f = jnp.sum(ends).astype(jnp.int32)
        issue_from = issued  # their arrivals are written at the next step's start
        issued = jnp.where(closed, jnp.minimum(issued + f, n), issued)
        iters = iters + jnp.where(go, k, 0.0)
        busy = busy + jnp.where(go, span, 0.0)
        tok_sum = tok_sum + jnp.where(go, k * tokens, 0.0)
        return (t_new, t_lo_new, p, new_q, done, kv_used, kv_peak, issue_from, issued,
                n_done + f, steps + active.astype(jnp.int32), iters, busy, tok_sum, slot_req,
                slot_gen, arrival, arrival_lo, admit, first, finish, slot_last, slot_last_lo,
                gap_count, gap_sum)

    int0 = jnp.zeros((), jnp.int32)
    f0 = jnp.zeros((), fin(0).dtype)
    issued0 = jnp.where(closed, jnp.minimum(fin(concurrency), fin(n)), fin(n)).astype(jnp.int32)
    state = (f0, f0, int0, int0, f0, f0, f0, issued0, issued0, int0, int0, f0, f0, f0,
             jnp.full((slots,), -1, jnp.int32), jnp.zeros((slots,), fin(0).dtype),
             arrival0, lo0, zeros, zeros, zeros, jnp.zeros((slots,), fin(0).dtype),
             jnp.zeros((slots,), fin(0).dtype), jnp.zeros((GAP_BINS,), fin(0).dtype),
             jnp.zeros((GAP_BINS,), fin(0).dtype))
    if differentiable:
        state = jax.lax.fori_loop(0, max_steps, lambda i, s: step(s), state)
    else:
        state = jax.lax.while_loop(lambda s: (s[9] < n) & (s[10] < max_steps),
                                   lambda s: jax.lax.fori_loop(0, STEP_BLOCK,
                                                               lambda i, s: step(s), s), state)
    (t, t_lo, _, _, _, _, kv_peak, issue_from, issued, n_done, steps, iters, busy, tok_sum, _,
     _, arrival, arrival_lo, admit, first, finish, _, _, gap_count, gap_sum) = state
    arrival, arrival_lo = issue(arrival, arrival_lo, issue_from, issued, t, t_lo)
    arrival = arrival + arrival_lo
    return Schedule(arrival=arrival, admit=arrival + admit, first_token=arrival + first,
                    finish=arrival + finish, queue=admit, ttft=first, e2e=finish,
                    completed=(n_done >= n).astype(f0.dtype), steps=steps, iterations=iters,
                    busy_time=busy, mean_tokens=tok_sum / jnp.maximum(iters, 1.0),
                    kv_peak=kv_peak, gap_count=gap_count, gap_sum=gap_sum)
