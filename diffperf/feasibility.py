"""Validity of a plan as an integer reason code (0 = feasible), computed with array ops so that
sweeps can mask infeasible rows, and turned into a readable message by `explain`."""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from .specs._hardware import PRECISIONS, Accelerator
from .specs._transformer import Transformer


class Reason(enum.IntEnum):
    """Why a plan is infeasible, in the order the checks run (the first failure is reported).

    An `IntEnum`: a report's integer `reason` compares equal to its member (`reason == 10` and
    `reason == Reason.HBM` are the same test). Codes 13-16 are the plan search's own
    (`diffperf.search_training`); `REASONS` holds the model's, 0-12."""

    FEASIBLE = 0
    TP_HEADS = 1
    TP_KV_HEADS = 2
    TP_FFN = 3
    BATCH_SPLIT = 4
    PIPELINE_LAYERS = 5
    INTERLEAVING = 6
    CP_SEQUENCE = 7
    EXPERT_LAYOUT = 8
    NO_TENSOR_CORES = 9
    HBM = 10
    NOT_WHOLE = 11
    HOST_MEMORY = 12
    SEARCH_GPUS = 13
    SEARCH_DUPLICATE = 14
    SEARCH_UNEVEN = 15
    SEARCH_OFFLOAD = 16


_TEXT = {
    Reason.FEASIBLE: "feasible",
    Reason.TP_HEADS: "tp does not divide heads",
    Reason.TP_KV_HEADS: "tp and kv_heads: neither divides the other",
    Reason.TP_FFN: "tp does not divide ffn_hidden (or dense_ffn_hidden / shared_ffn_hidden), or "
                   "expert_tp does not divide a MoE model's expert ffn_hidden",
    Reason.BATCH_SPLIT: "dp * micro_batch does not divide global_batch",
    Reason.PIPELINE_LAYERS: "pp * vp exceeds the layer slots (layers, + 2 for the embedding and "
                            "the loss with account_embedding_loss), or an end stage would hold "
                            "no transformer layer",
    Reason.INTERLEAVING: "interleaving (vp > 1) needs pp > 1 and a number of micro-batches "
                         "divisible by pp",
    Reason.CP_SEQUENCE: "2 * cp does not divide seq_len (context parallelism splits each sequence "
                        "into 2 * cp chunks)",
    Reason.EXPERT_LAYOUT: "ep does not divide num_experts, or (training) ep * expert_tp does not "
                          "divide tp * cp * dp, or (inference) ep does not divide tp",
    Reason.NO_TENSOR_CORES: "the GPU has no tensor cores for this precision",
    Reason.HBM: "does not fit in HBM",
    Reason.NOT_WHOLE: "a plan count is not a whole number >= 1 (tp, pp, dp, cp, ep, vp, "
                      "micro_batch, global_batch; batch, input_len, output_len; >= 0: expert_tp, "
                      "recompute_layers, offload_layers). Built from concrete values a plan "
                      "refuses these; traced values (inside jit / vmap) get this code",
    Reason.HOST_MEMORY: "offloaded activations, weights and optimizer states do not fit in "
                        "host memory",
}
#: The model's reason codes and their text (the search's own codes 13-16 are described by
#: `diffperf.search_training`).
REASONS = {int(r): text for r, text in _TEXT.items()}
#: Reasons of a valid plan that only runs out of memory (HBM, or host memory when offloading):
#: still predicted (published runs that ran are flagged with a warning, not failed).
MEMORY_REASONS = (Reason.HBM, Reason.HOST_MEMORY)
#: A structurally valid plan, which may not fit in HBM (what a sweep still ranks by memory).
VALID_OR_OUT_OF_HBM = (Reason.FEASIBLE, Reason.HBM)


def divides(a, b) -> jax.Array:
    """Whether `a` divides `b` (integer-valued floats): `b` is `a` times the integer nearest to
    `b / a`.

    Exact while the products are exact (b < 2^24 in float32): even an approximate quotient
    (XLA's vectorised division is not correctly rounded) rounds to the right integer when a
    divides b, and otherwise no integer multiple of a equals b. Unlike `jnp.mod`, which on
    floats lowers to a scalar `fmod` call per element and made the feasibility checks as
    costly as the step time, this vectorises.
    """
    k = jnp.round(b / a)
    return (k * a == b) & jnp.isfinite(k)


def tp_divides_mlps(tp, model: Transformer, expert_tp=None) -> jax.Array:
    """tp divides the width of every MLP the model has: the (expert) MLP (split over
    `expert_tp` when given, see `TrainingPlan.expert_layout`), a MoE model's dense-MLP layers
    and its shared expert."""
    ok = divides(tp if expert_tp is None else expert_tp, model.ffn_hidden)
    if not model.known_absent("dense_ffn_hidden"):  # else the dense width is ffn_hidden
        ok = ok & divides(tp, model.dense_width)
    if not model.known_absent("shared_ffn_hidden"):
        ok = ok & divides(tp, model.shared_width)
    return ok


def whole_counts(plan, positive: tuple[str, ...], nonnegative: tuple[str, ...] = ()) -> jax.Array:
    """Whether every field named in `positive` is a whole number >= 1 and every one in
    `nonnegative` a whole number >= 0 (reason 11 when not)."""
    ok = jnp.asarray(True)
    for names, low in ((positive, 1.0), (nonnegative, 0.0)):
        for name in names:
            x = getattr(plan, name)
            ok = ok & (x >= low) & (x == jnp.round(x)) & jnp.isfinite(x)
    return ok


def even_layout(model: Transformer, plan) -> jax.Array:
    """True where every pipeline stage (every interleaved chunk) holds the same whole number of
    layers: pp * vp divides the layer count (the layer count + 2 with
    `account_embedding_loss`, where the embedding and the loss fill one slot each).
    `train_step` models other layouts as perfectly balanced (fractional layers per stage), which
    needs a custom pipeline layout in practice and is optimistic when the per-GPU layer counts
    differ, so searches skip them by default."""
    return divides(plan.pp * plan.vp, plan.pipeline_slots(model.layers))


def offload_supported(model: Transformer, plan) -> jax.Array:
    """True where each offload of the plan is one its software runs: activations as
    Megatron-core allows (pp = 1, no recomputation, neither `recompute` nor
    `recompute_layers`, and fewer offloaded layers than the model has); optimizer states with
    a sharded optimizer (ZeRO >= 1: DeepSpeed's ZeRO-Offload, Megatron-core's optimizer CPU
    offload on its distributed optimizer); weights with ZeRO-3 (ZeRO-Infinity's
    `offload_param`). `train_step` models the other combinations too."""
    allowed = ((plan.pp == 1) & (plan.recompute == 0) & (plan.recompute_layers == 0)
               & (plan.offload_layers < model.layers))
    activations = (plan.offload_layers == 0) | allowed
    optimizer = (plan.offload_optimizer == 0) | (plan.zero >= 1)
    weights = (plan.offload_weights == 0) | (plan.zero >= 3)
    return activations & optimizer & weights


#: `TrainingPlan` counts checked by `whole_counts` (reason 11).
TRAINING_COUNTS = ("tp", "pp", "dp", "cp", "ep", "vp", "micro_batch", "global_batch")
TRAINING_COUNTS_OR_ZERO = ("expert_tp", "recompute_layers", "offload_layers")


def _first_failure(checks: list[jax.Array]) -> jax.Array:
    """Code (1-based position) of the first False in `checks`, 0 if all hold."""
    reason = jnp.zeros(jnp.broadcast_shapes(*[jnp.shape(c) for c in checks]), jnp.int32)
    for code in range(len(checks), 0, -1):
        reason = jnp.where(checks[code - 1], reason, code)
    return reason


def training_reason(model: Transformer, plan, acc: Accelerator, memory_total,
                    host_total=0.0) -> jax.Array:
    """Reason code of a training plan (see `REASONS`); `host_total` = offloaded bytes per GPU
    in host memory (activations, weights, optimizer states)."""
    m = plan.num_micro_batches
    etp = plan.expert_layout(model)[0]
    checks = [
        divides(plan.tp, model.heads),
        divides(plan.tp, model.kv_heads) | divides(model.kv_heads, plan.tp),
        tp_divides_mlps(plan.tp, model, etp),
        divides(plan.dp * plan.micro_batch, plan.global_batch),
        (plan.pp * plan.vp <= plan.pipeline_slots(model.layers))
        & (plan.end_stage_layers(model.layers) > 0),
        (plan.vp == 1) | ((plan.pp > 1) & divides(plan.pp, m)),
        (plan.cp == 1) | divides(2.0 * plan.cp, model.seq_len),
        divides(plan.ep, model.num_experts) & divides(etp * plan.ep, plan.tp * plan.cp * plan.dp),
        acc.peak_flops(plan.precision) > 0,
        memory_total <= acc.hbm_capacity,
        jnp.asarray(True),  # 11: checked first, below
        host_total <= acc.host_memory,
    ]
    counts = whole_counts(plan, TRAINING_COUNTS, TRAINING_COUNTS_OR_ZERO)
    return jnp.where(counts, _first_failure(checks), Reason.NOT_WHOLE)


def _expert_tp(plan, model: Transformer):
    """The tensor-parallel degree of a plan's expert MLPs (training or inference plan)."""
    if hasattr(plan, "expert_layout"):
        return plan.expert_layout(model)[0]
    return plan.tp / getattr(plan, "ep", 1.0)


def explain(reason: int, memory_total: float | None = None, capacity: float | None = None,
            precision: int | None = None) -> str:
    """Readable message for a reason code, with the numbers that matter when given."""
    reason = int(reason)
    text = REASONS.get(reason, f"unknown reason code {reason}")
    if reason in MEMORY_REASONS and memory_total is not None and capacity is not None:
        gb = lambda b: f"{b / 1e9:.1f}" if b < 1e15 else f"{b / 1e9:.3g}"  # noqa: E731
        text += f" (needs {gb(memory_total)} GB per GPU, has {gb(capacity)} GB)"
    if reason == 9 and precision is not None:
        text += f" ({PRECISIONS.get(int(precision), precision)})"
    return text


def describe_failure(reason: int, model: Transformer, plan) -> str:
    """`explain(reason)` with the values of the fields involved (for error messages)."""
    f = lambda x: f"{float(x):g}"  # noqa: E731
    details = {
        1: f"tp={f(plan.tp)}, heads={f(model.heads)}",
        2: f"tp={f(plan.tp)}, kv_heads={f(model.kv_heads)}",
        3: f"tp={f(plan.tp)}, " + (
            f"expert_tp={f(_expert_tp(plan, model))} (expert MLPs), "
            if float(model.num_experts) > 1 else "")
           + f"ffn_hidden={f(model.ffn_hidden)}" + "".join(
            f", {n}={f(getattr(model, n))}" for n in ("dense_ffn_hidden", "shared_ffn_hidden")
            if float(getattr(model, n)) > 0),
        5: f"pp={f(getattr(plan, 'pp', 1))}, vp={f(getattr(plan, 'vp', 1))}, "
           f"layers={f(model.layers)}",
        7: f"cp={f(getattr(plan, 'cp', 1))}, seq_len={f(model.seq_len)}",
        8: f"ep={f(getattr(plan, 'ep', 1))}, num_experts={f(model.num_experts)}" + (
            f", expert_tp={f(plan.expert_layout(model)[0])}, tp * cp * dp="
            f"{f(plan.tp * plan.cp * plan.dp)}" if hasattr(plan, "expert_layout")
            else f", tp={f(plan.tp)}"),
    }
    if reason == 4 and hasattr(plan, "global_batch"):
        details[4] = (f"dp={f(plan.dp)}, micro_batch={f(plan.micro_batch)}, "
                      f"global_batch={f(plan.global_batch)}")
    if reason == 6 and hasattr(plan, "global_batch"):
        details[6] = (f"pp={f(plan.pp)}, vp={f(plan.vp)}, micro-batches="
                      f"{f(plan.global_batch / (plan.dp * plan.micro_batch))}")
    if reason == 8 and float(model.num_experts) <= 1:
        return f"ep={f(getattr(plan, 'ep', 1))} needs a MoE model: this model has no experts"
    text = explain(reason, precision=getattr(plan, "precision", None))
    return f"{text} ({details[reason]})" if reason in details else text
