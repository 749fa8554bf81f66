"""Plain-Python reference of the serving engine's scheduler, for tests.

`reference_schedule` follows the contract in docs/serving.md, section "Scheduler semantics",
literally: iteration by iteration, one request at a time, with no vectorisation and no JAX. It
is the oracle the JAX `lax.scan` implementation (`diffperf.serving.simulate`) is checked
against: the same admissions, the same per-iteration quantities and the same per-request times.
Readability comes before speed; it is meant for small cases (hundreds of requests).

Units: times in seconds (s), lengths, budgets and KV capacities in tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

#: Scheduling policies by name (the same codes as `diffperf.specs.POLICIES`).
POLICIES = {"decode_first": 0, "prefill_first": 1}
#: Closed loop: the k-th request issued by the finishes of one iteration arrives k x this after
#: that iteration's end, s (docs/serving.md, "Traffic"): an ordering, not a latency. A client
#: sends its next request only once its last token has reached it, when a busy engine has
#: already started its next iteration; and clients do not send at the same instant, so an
#: idle engine starts on the first request that arrives.
CLOSED_LOOP_GAP = 1e-6


@dataclass(frozen=True)
class Iteration:
    """One scheduler iteration (docs/serving.md, steps 1-5).

    - `start`: time the iteration starts, s (admissions happen at this time).
    - `tokens`: decode tokens + prefill chunk tokens.
    - `emitting`: scheduled decoders + requests whose prompt completes in this iteration.
    - `decode_context`: sum over scheduled decoders of `input_len + generated` (generated
      counted before this iteration's token), tokens.
    - `prefill_pairs`: sum over chunks of `c * (done + c / 2)`.
    - `has_prefill`: any prefill chunk scheduled.
    - `duration`: `iteration_time(...)` of the above, s.
    - `admitted`: ids of the requests admitted at the start of this iteration.
    - `decoders`: ids of the requests given one decode token.
    - `chunks`: `(request id, chunk tokens)` of each prefill chunk, in admission order.
    - `finished`: ids of the requests that finish at the end of this iteration.
    """

    start: float
    tokens: int
    emitting: int
    decode_context: int
    prefill_pairs: float
    has_prefill: bool
    duration: float
    admitted: tuple[int, ...]
    decoders: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]
    finished: tuple[int, ...]

    @property
    def end(self) -> float:
        """Time the iteration ends, s."""
        return self.start + self.duration


@dataclass(frozen=True, eq=False)
class ReferenceResult:
    """What `reference_schedule` returns: per-request times (numpy float64 arrays, s; index =
    request id) and the per-iteration records.

    `arrival` holds the actual arrival times (in closed loop, the times the requests were
    issued). `input_len` / `output_len` are the request lengths (int arrays, tokens).
    """

    arrival: np.ndarray
    admit_time: np.ndarray
    first_token_time: np.ndarray
    finish_time: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    iterations: tuple[Iteration, ...]
    kv_peak: int = 0  # most KV tokens the running requests' contexts filled after an iteration

    @property
    def ttft(self) -> np.ndarray:
        """Time to first token, first_token_time - arrival, s."""
        return self.first_token_time - self.arrival

    @property
    def e2e(self) -> np.ndarray:
        """End-to-end latency, finish_time - arrival, s."""
        return self.finish_time - self.arrival

    @property
    def queue_delay(self) -> np.ndarray:
        """Queueing delay, admit_time - arrival, s."""
        return self.admit_time - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        """Time per output token, (finish_time - first_token_time) / (output_len - 1), s.
        A request with output_len == 1 has no inter-token gap: its TPOT is reported as 0
        (not NaN)."""
        gaps = np.maximum(self.output_len - 1, 1)
        return np.where(self.output_len > 1, (self.finish_time - self.first_token_time) / gaps,
                        0.0)

    @property
    def mean_itl(self) -> float:
        """Mean inter-token latency, sum(finish - first token) / sum(output_len - 1), s; 0 if
        no request has output_len > 1."""
        gaps = int(np.sum(self.output_len - 1))
        if gaps == 0:
            return 0.0
        return float(np.sum(self.finish_time - self.first_token_time)) / gaps

    @property
    def inter_token_gaps(self) -> np.ndarray:
        """Every inter-token gap of every request, s, in iteration order: from a request's
        first token (the end of the iteration that completes its prompt) to its next, and so
        on; a decoder left out of an iteration (prefill-first) has one longer gap."""
        last: dict[int, float] = {}
        gaps = []
        for it in self.iterations:
            for rid in it.decoders:
                gaps.append(it.end - last[rid])
                last[rid] = it.end
            for rid, _ in it.chunks:
                if self.first_token_time[rid] == it.end:
                    last[rid] = it.end
        return np.asarray(gaps, dtype=np.float64)

    @property
    def output_tokens_per_s(self) -> float:
        """Output throughput, sum(output_len) / (last finish - first arrival), tokens/s."""
        return float(np.sum(self.output_len)) / float(np.max(self.finish_time)
                                                      - np.min(self.arrival))


class _Request:
    """Scheduler state of one admitted request."""

    def __init__(self, rid: int, input_len: int, output_len: int, reservation: int):
        self.id = rid
        self.input_len = input_len
        self.output_len = output_len
        self.reservation = reservation
        self.prefilled = 0
        self.generated = 0

    @property
    def remaining_prompt(self) -> int:
        return self.input_len - self.prefilled


# ---------------------------------------------------------------------------------------------
# input checks: one-line ValueErrors naming the field and the value


def _integer(name: str, value, minimum: int) -> int:
    """`value` as an int, or a ValueError if it is not a whole number >= minimum."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}") from None
    if not math.isfinite(f) or f != int(f) or f < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(f)


def _lengths(name: str, values) -> list[int]:
    if values is None:
        raise ValueError(f"{name} is required, got None")
    return [_integer(f"{name}[{i}]", v, 1) for i, v in enumerate(values)]


def _policy(policy) -> int:
    if isinstance(policy, str):
        if policy.lower() not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)} or 0 / 1, got {policy!r}")
        return POLICIES[policy.lower()]
    code = _integer("policy", policy, 0)
    if code not in (0, 1):
        raise ValueError(f"policy must be one of {sorted(POLICIES)} or 0 / 1, got {policy!r}")
    return code


def _flag(name: str, value) -> bool:
    code = _integer(name, value, 0)
    if code not in (0, 1):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return bool(code)


def reservation(input_len: int, output_len: int, block_size: int) -> int:
    """KV tokens a request reserves at admission: ceil((input_len + output_len) / block_size)
    * block_size."""
    return -(-(input_len + output_len) // block_size) * block_size


# ---------------------------------------------------------------------------------------------


def reference_schedule(arrival: Sequence[float] | None, input_len: Sequence[int],
                       output_len: Sequence[int], *, max_num_seqs: int,
                       max_num_batched_tokens: int, chunked_prefill: int | bool,
                       policy: int | str, kv_capacity: float, block_size: int,
                       iteration_time: Callable[[int, int, int, float, bool], float],
                       concurrency: int | None = None,
                       max_iterations: int = 10_000_000,
                       kv_output_reserve: float = 1.0,
                       context_pass: int | bool = False) -> ReferenceResult:
    """Run the engine scheduler of docs/serving.md ("Scheduler semantics") on N requests.

    **Arguments:**

    - `arrival`: arrival time of each request, s, sorted nondecreasing (open loop). Ignored
      (may be None) when `concurrency` is given.
    - `input_len`, `output_len`: prompt and output tokens of each request, each >= 1.
    - `max_num_seqs`: S, request slots (requests running at once).
    - `max_num_batched_tokens`: B, token budget of one iteration, >= S.
    - `chunked_prefill`: 1 / True if a prompt may be split over iterations; 0 / False if a
      prompt's remaining tokens are scheduled whole or not at all (then every input_len <= B).
    - `policy`: 0 or "decode_first", 1 or "prefill_first".
    - `kv_capacity`: K, KV-cache tokens of the replica (`math.inf`: unlimited).
    - `block_size`: KV-cache block, tokens. An admitted request holds
      ceil((input_len + g + r (output_len - g)) / block_size) * block_size tokens, g =
      max(tokens generated, 1), r = `kv_output_reserve`; a request is admitted when what it
      holds fits beside what the running requests hold.
    - `iteration_time`: `iteration_time(tokens, emitting, decode_context, prefill_pairs,
      has_prefill) -> seconds` (ints, float, bool as docs/serving.md step 4 defines them);
      must return a finite number > 0.
    - `concurrency`: C for closed loop: requests 0 .. C-1 arrive at t = 0, and each finishing
      request issues the next one, the k-th of an iteration's finishes arriving k x
      `CLOSED_LOOP_GAP` after its end (so not in the next iteration, which has started). None:
      open loop.
    - `max_iterations`: a RuntimeError after this many iterations (a guard, not a limit of
      the model).
    - `kv_output_reserve`: r, share of the remaining output held ahead, 0-1 (1: the whole
      context reserved at admission; 0: the current context). Preemption is not modelled:
      `ReferenceResult.kv_peak` is the most KV tokens the running contexts filled.
    - `context_pass`: 1 / True: an iteration with prompt chunks takes the time of two passes
      (docs/serving.md step 4, `Engine.context_pass`): `iteration_time(chunk tokens - prompts
      completed, 0, 0, prefill_pairs, True)` (when that token count is > 0) plus, when anything
      emits, `iteration_time(emitting, emitting, decode_context + the completed prompts'
      input_len, 0.0, False)`.

    **Returns:** a `ReferenceResult`.
    """
    # ---- checks -----------------------------------------------------------------------------
    inputs = _lengths("input_len", input_len)
    outputs = _lengths("output_len", output_len)
    n = len(inputs)
    if n == 0:
        raise ValueError("input_len has no requests (N == 0); give at least one request")
    if len(outputs) != n:
        raise ValueError(f"output_len has {len(outputs)} entries, input_len has {n}")
    S = _integer("max_num_seqs", max_num_seqs, 1)
    B = _integer("max_num_batched_tokens", max_num_batched_tokens, 1)
    if B < S:
        raise ValueError(f"max_num_batched_tokens={B} must be >= max_num_seqs={S}")
    chunked = _flag("chunked_prefill", chunked_prefill)
    prefill_first = _policy(policy) == 1
    two_passes = _flag("context_pass", context_pass)
    block = _integer("block_size", block_size, 1)
    try:
        K = float(kv_capacity)
    except (TypeError, ValueError):
        raise ValueError(f"kv_capacity must be a number > 0, got {kv_capacity!r}") from None
    if math.isnan(K) or K <= 0:
        raise ValueError(f"kv_capacity must be a number > 0, got {kv_capacity!r}")
    if not callable(iteration_time):
        raise ValueError(f"iteration_time must be a callable, got {iteration_time!r}")
    max_iterations = _integer("max_iterations", max_iterations, 1)
    try:
        r_out = float(kv_output_reserve)
    except (TypeError, ValueError):
        raise ValueError(f"kv_output_reserve must be a number in [0, 1], got "
                         f"{kv_output_reserve!r}") from None
    if not 0.0 <= r_out <= 1.0:
        raise ValueError(f"kv_output_reserve must be a number in [0, 1], got "
                         f"{kv_output_reserve!r}")

    def holds(r: _Request) -> int:
        g = max(r.generated, 1)
        return math.ceil((r.input_len + g + r_out * (r.output_len - g)) / block) * block

    def fills(r: _Request) -> int:
        return -(-(r.input_len + max(r.generated, 1)) // block) * block

    if concurrency is None:
        if arrival is None:
            raise ValueError("arrival is required in open loop (concurrency=None), got None")
        arrivals: list[float | None] = []
        for i, a in enumerate(arrival):
            try:
                a = float(a)
            except (TypeError, ValueError):
                raise ValueError(f"arrival[{i}] must be a number, got {a!r}") from None
            if not math.isfinite(a) or a < 0:
                raise ValueError(f"arrival[{i}] must be a finite time >= 0 s, got {a!r}")
            arrivals.append(a)
        if len(arrivals) != n:
            raise ValueError(f"arrival has {len(arrivals)} entries, input_len has {n}")
        for i in range(1, n):
            if arrivals[i] < arrivals[i - 1]:
                raise ValueError(f"arrival must be sorted nondecreasing: arrival[{i}]="
                                 f"{arrivals[i]!r} < arrival[{i - 1}]={arrivals[i - 1]!r}")
        issued = n
    else:
        C = _integer("concurrency", concurrency, 1)
        issued = min(C, n)  # requests 0 .. issued-1 have an arrival time
        arrivals = [0.0] * issued + [None] * (n - issued)

    reservations = [reservation(i, o, block) for i, o in zip(inputs, outputs)]
    for i in range(n):
        if not chunked and inputs[i] > B:
            raise ValueError(f"input_len[{i}]={inputs[i]} exceeds max_num_batched_tokens={B} "
                             f"without chunked prefill: request {i} could never be scheduled")
        if reservations[i] > K:
            raise ValueError(f"request {i} reserves {reservations[i]} KV tokens (input_len "
                             f"{inputs[i]} + output_len {outputs[i]} rounded up to block_size "
                             f"{block}), more than kv_capacity={kv_capacity!r}: it could never "
                             "be admitted")

    # ---- the loop ---------------------------------------------------------------------------
    admit_time = [math.nan] * n
    first_token_time = [math.nan] * n
    finish_time = [math.nan] * n
    iterations: list[Iteration] = []

    t = 0.0
    p = 0  # next request to admit
    running: list[_Request] = []  # admitted, not finished, in admission order
    kv_peak = 0

    def arrived(i: int) -> bool:
        return arrivals[i] is not None and arrivals[i] <= t

    while True:
        # 1. Admission (2. Idle: jump to the next arrival and admit again)
        admitted: list[int] = []
        while True:
            while len(running) < S and p < n and arrived(p):
                new = _Request(p, inputs[p], outputs[p], reservations[p])
                if sum(holds(r) for r in running) + holds(new) > K:
                    break
                running.append(new)
                admit_time[p] = t
                admitted.append(p)
                p += 1
            if running:
                break
            if p == n:  # nothing running, nothing left: done
                return _result(arrivals, admit_time, first_token_time, finish_time, inputs,
                               outputs, iterations, kv_peak)
            nxt = arrivals[p]
            if nxt is None or nxt <= t:  # unreachable after the checks above
                raise RuntimeError(f"request {p} can never be admitted (nothing is running, "
                                   f"it has arrived, and it does not fit: reservation "
                                   f"{reservations[p]} > kv_capacity {K!r})")
            t = nxt

        if len(iterations) >= max_iterations:
            raise RuntimeError(f"reference_schedule ran max_iterations={max_iterations} "
                               f"iterations without finishing (t = {t!r} s, {p} of {n} "
                               "requests admitted); raise max_iterations")

        # 3. Schedule
        decoders = [r for r in running if r.prefilled == r.input_len]
        prefilling = [r for r in running if r.prefilled < r.input_len]
        if prefill_first and prefilling:
            scheduled_decoders: list[_Request] = []
            budget = B
        else:
            scheduled_decoders = decoders
            budget = B - len(decoders)
        chunks: list[tuple[_Request, int]] = []  # prefill chunks fill the rest of the budget
        for r in prefilling:
            if chunked:
                c = min(r.remaining_prompt, budget)
            else:  # whole remaining prompt or nothing (then head-of-line: stop)
                c = r.remaining_prompt if r.remaining_prompt <= budget else 0
            if c == 0:
                break
            chunks.append((r, c))
            budget -= c

        # 4. Iteration time
        tokens = len(scheduled_decoders) + sum(c for _, c in chunks)
        completing = [r for r, c in chunks if r.prefilled + c == r.input_len]
        emitting = len(scheduled_decoders) + len(completing)
        decode_context = sum(r.input_len + r.generated for r in scheduled_decoders)
        prefill_pairs = sum(c * (r.prefilled + c / 2) for r, c in chunks)
        has_prefill = len(chunks) > 0
        if two_passes and has_prefill:
            ctx_tokens = tokens - len(scheduled_decoders) - len(completing)
            duration = 0.0
            if ctx_tokens > 0:
                duration = iteration_time(ctx_tokens, 0, 0, float(prefill_pairs), True)
            if emitting > 0 or ctx_tokens == 0:
                duration += iteration_time(emitting, emitting, decode_context + sum(
                    r.input_len for r in completing), 0.0, False)
        else:
            duration = iteration_time(tokens, emitting, decode_context, float(prefill_pairs),
                                      has_prefill)
        try:
            duration = float(duration)
        except (TypeError, ValueError):
            raise ValueError(f"iteration_time must return a number of seconds, got "
                             f"{duration!r}") from None
        if not math.isfinite(duration) or duration <= 0:
            raise ValueError(f"iteration_time must return a finite time > 0 s, got {duration!r} "
                             f"for tokens={tokens}, emitting={emitting}, decode_context="
                             f"{decode_context}, prefill_pairs={float(prefill_pairs)!r}, "
                             f"has_prefill={has_prefill}")
        start = t

        # 5. Advance time and update the requests
        t = t + duration
        for r in scheduled_decoders:
            r.generated += 1
        for r, c in chunks:
            r.prefilled += c
            if r.prefilled == r.input_len:
                r.generated = 1
                first_token_time[r.id] = t
        kv_peak = max(kv_peak, sum(fills(r) for r in running))
        finished = [r for r in running if r.generated == r.output_len]
        sent = 0
        for r in finished:  # in admission order
            finish_time[r.id] = t
            running.remove(r)
            if issued < n:  # closed loop: the next request arrives just after now
                sent += 1
                arrivals[issued] = t + sent * CLOSED_LOOP_GAP
                issued += 1

        iterations.append(Iteration(
            start=start, tokens=tokens, emitting=emitting, decode_context=decode_context,
            prefill_pairs=float(prefill_pairs), has_prefill=has_prefill, duration=duration,
            admitted=tuple(admitted), decoders=tuple(r.id for r in scheduled_decoders),
            chunks=tuple((r.id, c) for r, c in chunks), finished=tuple(r.id for r in finished)))


def _result(arrivals, admit_time, first_token_time, finish_time, inputs, outputs,
            iterations, kv_peak: int = 0) -> ReferenceResult:
    f = lambda xs: np.asarray(xs, dtype=np.float64)
    return ReferenceResult(
        arrival=f(arrivals), admit_time=f(admit_time), first_token_time=f(first_token_time),
        finish_time=f(finish_time), input_len=np.asarray(inputs, dtype=np.int64),
        output_len=np.asarray(outputs, dtype=np.int64), iterations=tuple(iterations),
        kv_peak=kv_peak)
