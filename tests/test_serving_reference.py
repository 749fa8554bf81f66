"""The plain-Python reference scheduler (`diffperf.serving._reference`) on small cases whose
expected times are worked out by hand in the comments, from the rules of docs/serving.md
("Scheduler semantics"), not from the code. Times in s, lengths in tokens."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from diffperf.serving._reference import CLOSED_LOOP_GAP, POLICIES, reference_schedule

ONE = lambda *args: 1.0  # every iteration takes 1 s


def run(arrival, input_len, output_len, **kw):
    """`reference_schedule` with roomy defaults (8 slots, 64-token budget, chunked prefill,
    decode_first, unlimited KV, block 1, 1 s iterations), overridden by `kw`."""
    args = dict(max_num_seqs=8, max_num_batched_tokens=64, chunked_prefill=1, policy=0,
                kv_capacity=math.inf, block_size=1, iteration_time=ONE)
    args.update(kw)
    return reference_schedule(arrival, input_len, output_len, **args)


def fields(it):
    return (it.start, it.tokens, it.emitting, it.decode_context, it.prefill_pairs,
            it.has_prefill, it.duration)


def test_policy_codes_match_the_engine_spec():
    from diffperf.specs._engine import POLICIES as ENGINE_POLICIES
    assert POLICIES == ENGINE_POLICIES


def test_one_request():
    # input 4, output 3, 1 s iterations.
    # it0 t=0: admit r0; prefill chunk 4 (done 0): tokens 4, emitting 1 (prompt completes),
    #   decode_context 0, pairs 4*(0+2) = 8 -> t=1: first token (generated 1).
    # it1 t=1: decode, context 4+1 = 5 -> t=2 (generated 2).
    # it2 t=2: decode, context 4+2 = 6 -> t=3 (generated 3 = output): finish at 3.
    r = run([0.0], [4], [3])
    assert [fields(it) for it in r.iterations] == [
        (0.0, 4, 1, 0, 8.0, True, 1.0),
        (1.0, 1, 1, 5, 0.0, False, 1.0),
        (2.0, 1, 1, 6, 0.0, False, 1.0),
    ]
    assert r.iterations[0].admitted == (0,) and r.iterations[2].finished == (0,)
    assert r.admit_time.tolist() == [0.0]
    assert r.first_token_time.tolist() == [1.0]
    assert r.finish_time.tolist() == [3.0]
    assert r.ttft.tolist() == [1.0]
    assert r.e2e.tolist() == [3.0]
    assert r.queue_delay.tolist() == [0.0]
    assert r.tpot.tolist() == [1.0]  # (3 - 1) / (3 - 1)
    assert r.mean_itl == 1.0
    assert r.output_tokens_per_s == 1.0  # 3 tokens / (3 - 0) s


def test_queueing_on_one_slot_and_idle_jump():
    # S = 1. r0 (arrives 0, in 2, out 2), r1 (arrives 0.5, in 2, out 2), r2 (arrives 10,
    # in 3, out 1).
    # it0 t=0: admit r0, prefill 2 -> t=1, r0 first token.
    # it1 t=1: r1 has arrived but the slot is taken; r0 decodes -> t=2, r0 finishes.
    # it2 t=2: admit r1 (queueing delay 1.5); prefill -> t=3, r1 first token.
    # it3 t=3: r1 decodes -> t=4, r1 finishes.
    # idle: nothing runs, t jumps to r2's arrival 10; it4 t=10: admit r2, prefill 3 -> t=11,
    #   first token = last token (output 1): finish at 11, TPOT reported as 0.
    r = run([0.0, 0.5, 10.0], [2, 2, 3], [2, 2, 1], max_num_seqs=1)
    assert r.admit_time.tolist() == [0.0, 2.0, 10.0]
    assert r.first_token_time.tolist() == [1.0, 3.0, 11.0]
    assert r.finish_time.tolist() == [2.0, 4.0, 11.0]
    assert r.queue_delay.tolist() == [0.0, 1.5, 0.0]
    assert r.ttft.tolist() == [1.0, 2.5, 1.0]
    assert r.e2e.tolist() == [2.0, 3.5, 1.0]
    assert r.tpot.tolist() == [1.0, 1.0, 0.0]
    assert [it.start for it in r.iterations] == [0.0, 1.0, 2.0, 3.0, 10.0]
    assert [it.admitted for it in r.iterations] == [(0,), (), (1,), (), (2,)]
    assert r.mean_itl == 1.0  # (1 + 1 + 0) / (1 + 1 + 0)
    assert r.output_tokens_per_s == 5 / 11  # 5 tokens / (11 - 0) s


def test_decode_first_mixes_prefill_first_pauses():
    # r0 (arrives 0, in 2, out 4), r1 (arrives 1.5, in 3, out 2); S=4, B=8, chunked.
    arrival, inp, out = [0.0, 1.5], [2, 3], [4, 2]

    # decode_first:
    # it0 t=0: admit r0, prefill 2 -> t=1, r0 generated 1 (first token 1).
    # it1 t=1: r1 not arrived (1.5 > 1); r0 decodes (context 2+1=3) -> t=2, generated 2.
    # it2 t=2: admit r1. r0 decodes (context 2+2=4), budget 8-1=7, r1 chunk 3 (pairs
    #   3*(0+1.5)=4.5): tokens 1+3=4, emitting 2 (r0's decode + r1's completed prompt)
    #   -> t=3: r0 generated 3, r1 first token at 3.
    # it3 t=3: both decode, context (2+3)+(3+1)=9 -> t=4: r0 generated 4 = out, r1 2 = out:
    #   both finish at 4.
    d = run(arrival, inp, out, max_num_seqs=4, max_num_batched_tokens=8, policy=0)
    assert [fields(it) for it in d.iterations] == [
        (0.0, 2, 1, 0, 2.0, True, 1.0),
        (1.0, 1, 1, 3, 0.0, False, 1.0),
        (2.0, 4, 2, 4, 4.5, True, 1.0),
        (3.0, 2, 2, 9, 0.0, False, 1.0),
    ]
    assert d.iterations[2].decoders == (0,) and d.iterations[2].chunks == ((1, 3),)
    assert d.first_token_time.tolist() == [1.0, 3.0]
    assert d.finish_time.tolist() == [4.0, 4.0]

    # prefill_first: same until it2.
    # it2 t=2: admit r1; a prompt is pending, so prefill only: r1 chunk 3, tokens 3, emitting 1,
    #   no decode context -> t=3: r1 first token; r0 paused (still generated 2).
    # it3 t=3: both decode, context (2+2)+(3+1)=8 -> t=4: r0 generated 3, r1 2: r1 finishes.
    # it4 t=4: r0 decodes, context 2+3=5 -> t=5: r0 finishes, one iteration later than with
    #   decode_first.
    p = run(arrival, inp, out, max_num_seqs=4, max_num_batched_tokens=8, policy="prefill_first")
    assert [fields(it) for it in p.iterations] == [
        (0.0, 2, 1, 0, 2.0, True, 1.0),
        (1.0, 1, 1, 3, 0.0, False, 1.0),
        (2.0, 3, 1, 0, 4.5, True, 1.0),
        (3.0, 2, 2, 8, 0.0, False, 1.0),
        (4.0, 1, 1, 5, 0.0, False, 1.0),
    ]
    assert p.iterations[2].decoders == ()
    assert p.first_token_time.tolist() == [1.0, 3.0]
    assert p.finish_time.tolist() == [5.0, 4.0]
    assert p.finish_time[0] == d.finish_time[0] + 1.0


def test_chunked_prefill_chunks_and_pairs():
    # r0 (arrives 0, in 1, out 2), r1 (arrives 0.5, in 10, out 2); S=2, B=4, chunked.
    arrival, inp, out = [0.0, 0.5], [1, 10], [2, 2]

    # decode_first:
    # it0 t=0: admit r0, chunk 1 (pairs 1*(0+0.5)=0.5) -> t=1, r0 first token.
    # it1 t=1: admit r1. r0 decodes (context 1+1=2), budget 4-1=3: r1 chunk 3 (done 0,
    #   pairs 3*(0+1.5)=4.5); tokens 4, emitting 1 (r1's prompt not complete) -> t=2:
    #   r0 finishes (generated 2).
    # it2 t=2: no decoder, budget 4: chunk 4 (done 3, pairs 4*(3+2)=20); tokens 4, emitting 0
    #   -> t=3.
    # it3 t=3: chunk 3 (done 7, pairs 3*(7+1.5)=25.5); emitting 1 -> t=4: r1 first token.
    # it4 t=4: r1 decodes (context 10+1=11) -> t=5: r1 finishes.
    # Chunks 3, 4, 3; pairs 4.5 + 20 + 25.5 = 50 = 10^2 / 2.
    d = run(arrival, inp, out, max_num_seqs=2, max_num_batched_tokens=4, policy=0)
    assert [fields(it) for it in d.iterations] == [
        (0.0, 1, 1, 0, 0.5, True, 1.0),
        (1.0, 4, 1, 2, 4.5, True, 1.0),
        (2.0, 4, 0, 0, 20.0, True, 1.0),
        (3.0, 3, 1, 0, 25.5, True, 1.0),
        (4.0, 1, 1, 11, 0.0, False, 1.0),
    ]
    assert [it.chunks for it in d.iterations[1:4]] == [((1, 3),), ((1, 4),), ((1, 3),)]
    assert d.first_token_time.tolist() == [1.0, 4.0]
    assert d.finish_time.tolist() == [2.0, 5.0]

    # prefill_first: it1 t=1: r1 pending, prefill only with budget 4: chunk 4 (pairs 4*2=8),
    #   r0 paused. it2: chunk 4 (done 4, pairs 4*(4+2)=24). it3: chunk 2 (done 8,
    #   pairs 2*(8+1)=18) -> t=4: r1 first token (8 + 24 + 18 = 50).
    # it4 t=4: both decode, context (1+1)+(10+1)=13 -> t=5: both finish.
    p = run(arrival, inp, out, max_num_seqs=2, max_num_batched_tokens=4, policy=1)
    assert [fields(it) for it in p.iterations] == [
        (0.0, 1, 1, 0, 0.5, True, 1.0),
        (1.0, 4, 0, 0, 8.0, True, 1.0),
        (2.0, 4, 0, 0, 24.0, True, 1.0),
        (3.0, 2, 1, 0, 18.0, True, 1.0),
        (4.0, 2, 2, 13, 0.0, False, 1.0),
    ]
    assert p.first_token_time.tolist() == [1.0, 4.0]
    assert p.finish_time.tolist() == [5.0, 5.0]


def test_prompts_share_the_budget_in_admission_order():
    # Three prompts of 3 tokens at t=0, output 1, S=3, B=4, chunked.
    # it0: r0 chunk 3 (pairs 4.5, b=1), r1 chunk 1 (pairs 0.5, b=0), r2 gets 0: stop.
    #   -> t=1: r0 first token = finish.
    # it1: r1 chunk 2 (done 1, pairs 2*(1+1)=4, b=2), r2 chunk 2 (pairs 2*(0+1)=2)
    #   -> t=2: r1 finishes.
    # it2: r2 chunk 1 (done 2, pairs 1*(2+0.5)=2.5) -> t=3: r2 finishes.
    r = run([0.0] * 3, [3, 3, 3], [1, 1, 1], max_num_seqs=3, max_num_batched_tokens=4)
    assert [it.chunks for it in r.iterations] == [((0, 3), (1, 1)), ((1, 2), (2, 2)), ((2, 1),)]
    assert [it.prefill_pairs for it in r.iterations] == [5.0, 6.0, 2.5]
    assert [it.emitting for it in r.iterations] == [1, 1, 1]
    assert r.finish_time.tolist() == [1.0, 2.0, 3.0]
    assert r.tpot.tolist() == [0.0, 0.0, 0.0]
    assert r.mean_itl == 0.0  # no request has output_len > 1


def test_unchunked_prompt_waits_head_of_line():
    # B=4, no chunking. r0 (in 2, out 3), r1 (in 4, out 1), r2 (in 1, out 1), all at 0, S=3.
    # it0 t=0: admit all; no decoder, b=4: r0 whole (2), b=2; r1 needs 4 > 2: stop (r2 would
    #   fit but waits behind r1) -> t=1: r0 first token.
    # it1, it2: r0 decodes, b=3 < 4: r1 still waits -> t=3: r0 finishes (generated 3).
    # it3 t=3: b=4: r1 whole (4), b=0; r2 needs 1 > 0: stop -> t=4: r1 finishes.
    # it4 t=4: r2 whole -> t=5: r2 finishes.
    r = run([0.0] * 3, [2, 4, 1], [3, 1, 1], max_num_seqs=3, max_num_batched_tokens=4,
            chunked_prefill=0)
    assert [it.chunks for it in r.iterations] == [((0, 2),), (), (), ((1, 4),), ((2, 1),)]
    assert [it.tokens for it in r.iterations] == [2, 1, 1, 4, 1]
    assert r.admit_time.tolist() == [0.0, 0.0, 0.0]
    assert r.first_token_time.tolist() == [1.0, 4.0, 5.0]
    assert r.finish_time.tolist() == [3.0, 4.0, 5.0]

    # The same with chunking: it0 r0 2 + r1 2 (b=0) -> t=1 r0 first token; it1: r0 decodes,
    # r1 chunk 2 completes, b=1: r2 chunk 1 -> t=2: r1 and r2 first (= last) tokens.
    c = run([0.0] * 3, [2, 4, 1], [3, 1, 1], max_num_seqs=3, max_num_batched_tokens=4)
    assert c.finish_time.tolist() == [3.0, 2.0, 2.0]


def test_kv_admission_and_block_rounding():
    # block 16: r0 in 10 + out 7 = 17 tokens reserves 32; r1 in 1 + out 1 = 2 reserves 16.
    # K = 32: r1 does not fit while r0 runs.
    # it0 t=0: admit r0 only; prefill -> t=1 first token; 6 decodes -> r0 finishes at 7.
    # it7 t=7: r0's 32 tokens are free: admit r1, prefill -> t=8: first = last token.
    r = run([0.0, 0.0], [10, 1], [7, 1], kv_capacity=32, block_size=16)
    assert r.admit_time.tolist() == [0.0, 7.0]
    assert r.first_token_time.tolist() == [1.0, 8.0]
    assert r.finish_time.tolist() == [7.0, 8.0]
    assert r.queue_delay.tolist() == [0.0, 7.0]

    # Exact multiples are not rounded up: 10 + 6 = 16 and 1 + 15 = 16 reserve 16 each: both fit.
    r = run([0.0, 0.0], [10, 1], [6, 15], kv_capacity=32, block_size=16)
    assert r.admit_time.tolist() == [0.0, 0.0]

    # Head-of-line: K = 48, r0 reserves 32 (free 16); r1 (20 + 5 = 25 -> 32) does not fit, and
    # r2 (1 + 1 -> 16) would, but waits behind r1. r0 (in 10, out 7) finishes at 7; then r1
    # and r2 are admitted together (32 + 16 = 48).
    r = run([0.0] * 3, [10, 20, 1], [7, 5, 1], kv_capacity=48, block_size=16)
    assert r.admit_time.tolist() == [0.0, 7.0, 7.0]

    # A reservation larger than the whole cache can never be admitted: refused up front.
    with pytest.raises(ValueError, match=r"request 0 reserves 32 KV tokens.*kv_capacity=31"):
        run([0.0], [10], [7], kv_capacity=31, block_size=16)


def test_closed_loop_concurrency():
    # C = 2, 4 requests: r0 (in 2, out 3), r1 (in 2, out 1), r2 (in 2, out 2), r3 (in 2, out 1);
    # every iteration 1 s; e = CLOSED_LOOP_GAP.
    # it0 t=0: r0, r1 arrive and are admitted; both prefill -> t=1: r0 first token,
    #   r1 first = last token: r1 finishes at 1, so r2 arrives at 1 + e, after it1 began.
    # it1 t=1: r0 decodes (context 2+1=3) -> t=2.
    # it2 t=2: admit r2; r0 decodes (context 4), r2 prefills -> t=3: r0 finishes, r2 first
    #   token; r3 arrives at 3 + e.
    # it3 t=3: r2 decodes (context 3) -> t=4: r2 finishes.
    # it4 t=4: admit r3, prefill -> t=5: r3 finishes.
    e = CLOSED_LOOP_GAP
    for arrival in (None, [5.0, 4.0, 3.0, 2.0]):  # ignored in closed loop
        r = run(arrival, [2, 2, 2, 2], [3, 1, 2, 1], concurrency=2)
        assert r.arrival.tolist() == pytest.approx([0.0, 0.0, 1.0 + e, 3.0 + e], abs=1e-12)
        assert r.admit_time.tolist() == [0.0, 0.0, 2.0, 4.0]
        assert r.first_token_time.tolist() == [1.0, 1.0, 3.0, 5.0]
        assert r.finish_time.tolist() == [3.0, 1.0, 4.0, 5.0]
        assert [it.decode_context for it in r.iterations] == [0, 3, 4, 3, 0]
        # arrivals of r2, r3 = just after the first two finish times (sorted)
        assert r.arrival[2:].tolist() == pytest.approx(
            [x + e for x in sorted(r.finish_time)[:2]], abs=1e-12)

    # Two finishing in one iteration issue the next two one after another, and the idle engine
    # starts on the first. C = 2: r0, r1 (in 1, out 1) finish at 1; r2 arrives at 1 + e and
    # runs alone (finishes at 2 + e), r3 (1 + 2e) joins the next iteration (finishes 3 + e).
    r = run(None, [1] * 4, [1] * 4, concurrency=2)
    assert r.arrival.tolist() == pytest.approx([0.0, 0.0, 1.0 + e, 1.0 + 2 * e], abs=1e-12)
    assert r.finish_time.tolist() == pytest.approx([1.0, 1.0, 2.0 + e, 3.0 + e], abs=1e-12)

    # C larger than N: everything arrives at 0.
    r = run(None, [1] * 3, [1] * 3, concurrency=10)
    assert r.arrival.tolist() == [0.0, 0.0, 0.0]


def test_iteration_time_from_its_arguments():
    def cost(tokens, emitting, decode_context, prefill_pairs, has_prefill):
        return (0.01 + 0.001 * tokens + 1e-5 * decode_context + 1e-6 * prefill_pairs
                + 0.002 * has_prefill)

    # r0 (arrives 0, in 4, out 2), r1 (arrives 0.01, in 2, out 1); S=2, B=8, decode_first.
    # it0 t=0: r0 prefill 4: tokens 4, pairs 4*2=8, has_prefill:
    #   T = 0.01 + 0.004 + 8e-6 + 0.002 = 0.016008 -> r0 first token at 0.016008.
    # it1 t=0.016008: admit r1 (arrived 0.01; queue 0.006008). r0 decodes (context 4+1=5),
    #   r1 chunk 2 (pairs 2*1=2): tokens 3, emitting 2:
    #   T = 0.01 + 0.003 + 5e-5 + 2e-6 + 0.002 = 0.015052 -> t = 0.03106: r0 finishes
    #   (generated 2), r1 first = last token.
    r = run([0.0, 0.01], [4, 2], [2, 1], max_num_seqs=2, max_num_batched_tokens=8,
            iteration_time=cost)
    its = r.iterations
    assert len(its) == 2
    assert (its[0].tokens, its[0].emitting, its[0].decode_context) == (4, 1, 0)
    assert (its[1].tokens, its[1].emitting, its[1].decode_context) == (3, 2, 5)
    assert its[0].duration == pytest.approx(0.016008, rel=1e-12)
    assert its[1].duration == pytest.approx(0.015052, rel=1e-12)
    np.testing.assert_allclose(r.first_token_time, [0.016008, 0.03106], rtol=1e-12)
    np.testing.assert_allclose(r.finish_time, [0.03106, 0.03106], rtol=1e-12)
    np.testing.assert_allclose(r.queue_delay, [0.0, 0.006008], rtol=1e-12)
    np.testing.assert_allclose(r.ttft, [0.016008, 0.02106], rtol=1e-12)
    np.testing.assert_allclose(r.tpot, [0.015052, 0.0], rtol=1e-12)


def test_iteration_time_gets_plain_python_types():
    seen = []

    def record(*args):
        seen.append(tuple(type(a) for a in args))
        return 1.0

    run([0.0], [3], [2], iteration_time=record)
    assert seen == [(int, int, int, float, bool)] * 2


BASE = dict(arrival=[0.0, 1.0], input_len=[4, 4], output_len=[2, 2])


@pytest.mark.parametrize("change, error", [
    (dict(arrival=[], input_len=[], output_len=[]), r"N == 0"),
    (dict(input_len=[4, 0]), r"input_len\[1\] must be a whole number >= 1, got 0"),
    (dict(input_len=[4, 2.5]), r"input_len\[1\]"),
    (dict(output_len=[0, 2]), r"output_len\[0\] must be a whole number >= 1"),
    (dict(output_len=[2]), r"output_len has 1 entries"),
    (dict(arrival=[1.0, 0.0]), r"arrival must be sorted.*arrival\[1\]=0.0"),
    (dict(arrival=[0.0]), r"arrival has 1 entries"),
    (dict(arrival=[0.0, math.nan]), r"arrival\[1\]"),
    (dict(arrival=None), r"arrival is required"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4),
     r"max_num_batched_tokens=4 must be >= max_num_seqs=8"),
    (dict(max_num_seqs=0), r"max_num_seqs must be a whole number >= 1"),
    (dict(chunked_prefill=0, max_num_batched_tokens=3, max_num_seqs=2),
     r"input_len\[0\]=4 exceeds max_num_batched_tokens=3 without chunked prefill"),
    (dict(chunked_prefill=2), r"chunked_prefill must be 0 or 1"),
    (dict(policy="fifo"), r"policy must be one of"),
    (dict(policy=2), r"policy must be one of"),
    # 4 + 2 = 6 -> 8 fits; 7 + 2 = 9 -> 12 does not
    (dict(kv_capacity=8, block_size=4, input_len=[4, 7]), r"request 1 reserves 12 KV tokens"),
    (dict(kv_capacity=0), r"kv_capacity must be a number > 0"),
    (dict(block_size=0), r"block_size must be a whole number >= 1"),
    (dict(iteration_time=lambda *a: 0.0), r"iteration_time must return a finite time > 0 s"),
    (dict(iteration_time=lambda *a: -1.0), r"iteration_time must return a finite time > 0 s"),
    (dict(iteration_time=lambda *a: math.nan), r"iteration_time must return a finite time"),
    (dict(iteration_time=lambda *a: math.inf), r"iteration_time must return a finite time"),
    (dict(iteration_time=lambda *a: None), r"iteration_time must return a number"),
    (dict(iteration_time=3.0), r"iteration_time must be a callable"),
    (dict(concurrency=0), r"concurrency must be a whole number >= 1, got 0"),
])
def test_bad_input_names_the_field(change, error):
    args = dict(BASE, max_num_seqs=2, max_num_batched_tokens=8, chunked_prefill=1, policy=0,
                kv_capacity=1000, block_size=1, iteration_time=ONE)
    args.update(change)
    arrival, inp, out = args.pop("arrival"), args.pop("input_len"), args.pop("output_len")
    with pytest.raises(ValueError, match=error) as info:
        reference_schedule(arrival, inp, out, **args)
    assert "\n" not in str(info.value)


def test_max_iterations_guard():
    # one request, in 1, out 5: 5 iterations; a limit of 4 stops it
    assert len(run([0.0], [1], [5], max_iterations=5).iterations) == 5
    with pytest.raises(RuntimeError, match="max_iterations=4"):
        run([0.0], [1], [5], max_iterations=4)


@pytest.mark.parametrize("seed", range(20))
def test_invariants_on_random_traffic(seed):
    """Conservation laws that hold whatever the settings: budgets, slots and KV respected,
    every prompt token prefilled once, output_len - 1 decode tokens per request, causal pairs
    s^2 / 2 per prompt, and the times ordered."""
    rng = random.Random(seed)
    n = rng.randint(1, 25)
    S = rng.randint(1, 6)
    B = rng.randint(S, 24)
    chunked = rng.randint(0, 1)
    block = rng.choice([1, 4, 16])
    inp = [rng.randint(1, B if not chunked else 40) for _ in range(n)]
    out = [rng.randint(1, 8) for _ in range(n)]
    K = max(-(-(i + o) // block) * block for i, o in zip(inp, out)) * rng.choice([1, 2, 4])
    arrival = sorted(round(rng.uniform(0, 10), 1) for _ in range(n))
    concurrency = rng.choice([None, None, rng.randint(1, 5)])
    cost = lambda tok, emit, ctx, pairs, pre: 0.1 + 0.01 * tok + 1e-3 * ctx + 1e-4 * pairs
    r = run(arrival, inp, out, max_num_seqs=S, max_num_batched_tokens=B,
            chunked_prefill=chunked, policy=rng.randint(0, 1), kv_capacity=K,
            block_size=block, iteration_time=cost, concurrency=concurrency)

    prefilled = [0] * n
    decoded = [0] * n
    running: set[int] = set()
    t = 0.0
    for it in r.iterations:
        assert it.start >= t
        t = it.start + it.duration
        running |= set(it.admitted)
        assert len(running) <= S
        assert sum(-(-(inp[i] + out[i]) // block) * block for i in running) <= K
        assert it.tokens == len(it.decoders) + sum(c for _, c in it.chunks) <= B
        assert it.tokens >= 1
        assert set(it.decoders) | {i for i, _ in it.chunks} <= running
        for i, c in it.chunks:
            assert c >= 1
            if not chunked:
                assert c == inp[i]
            prefilled[i] += c
        for i in it.decoders:
            decoded[i] += 1
        running -= set(it.finished)
    assert not running
    assert prefilled == inp
    assert decoded == [o - 1 for o in out]
    assert sum(it.prefill_pairs for it in r.iterations) == pytest.approx(
        sum(s * s / 2 for s in inp))
    assert sum(it.emitting for it in r.iterations) == sum(out)
    assert np.all(r.arrival <= r.admit_time)
    assert np.all(r.admit_time < r.first_token_time)
    assert np.all(r.first_token_time <= r.finish_time)
    assert np.all(np.isfinite(r.tpot)) and np.all(r.tpot >= 0)
    # first come first served: admissions in id order
    assert np.all(np.diff(r.admit_time) >= 0)
    if concurrency is None:
        assert r.arrival.tolist() == arrival
