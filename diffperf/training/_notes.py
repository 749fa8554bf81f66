"""Caveats of a training plan that is valid but modelled with a simplification: an uneven
pipeline layout, offloading Megatron-core does not run, ZeRO-3 with pipelining, sequence
parallelism without tensor parallelism. `diffperf train` prints them as notes; `diffperf
predict` adds them to a row's status."""

from __future__ import annotations

import jax
import numpy as np

from .._stored_programs import stored_jit
from ..feasibility import even_layout, offload_supported
from ..specs._training_plan import TrainingPlan
from ..specs._transformer import Transformer


@stored_jit
def _conditions(model: Transformer, plan: TrainingPlan):
    """`even_layout` and `offload_supported`, in one compiled program (exact integer
    arithmetic and comparisons: the same as evaluated eagerly, where they would compile a dozen
    small programs one at a time, 0.1-0.2 s of a `diffperf train`)."""
    return even_layout(model, plan), offload_supported(model, plan)


def training_notes_batch(model: Transformer, plan: TrainingPlan) -> list[list[str]]:
    """The caveats of each configuration of a batch (leaves of shape [n] or scalars; the
    conditions are evaluated for the whole batch at once): one list of sentences per row."""
    even, offload_ok = _conditions(model, plan)
    v = jax.device_get({"even": even, "offload_ok": offload_ok, "layers": model.layers,
                        "tp": plan.tp, "pp": plan.pp, "vp": plan.vp, "zero": plan.zero,
                        "sp": plan.sequence_parallel, "emb": plan.account_embedding_loss})
    n = max(np.size(x) for x in v.values())
    v = {k: np.broadcast_to(np.asarray(x), (n,)) for k, x in v.items()}
    even, offload_ok = v["even"], v["offload_ok"]
    out = []
    for i in range(n):
        layers, tp, pp, vp = (float(v[k][i]) for k in ("layers", "tp", "pp", "vp"))
        notes = []
        if not even[i]:
            chunks = pp * vp
            slots = f"{layers:g} layers"
            if v["emb"][i] > 0 and pp > 1:
                layers += 2.0  # the embedding and the loss take one slot each
                slots = f"{layers:g} slots ({layers - 2:g} layers + embedding + loss)"
            notes.append(f"uneven layout: {slots} over pp*vp = {chunks:g} stages/chunks "
                         f"({layers / chunks:.2f} each) needs a custom pipeline layout; modelled "
                         f"as perfectly balanced (optimistic when the per-GPU layer counts differ)")
        if not offload_ok[i]:
            notes.append("Megatron-core offloads activations only with pp = 1, no recomputation "
                         "and fewer layers than the model has; modelled anyway")
        if v["zero"][i] == 3 and pp > 1:
            notes.append("ZeRO-3 with pp > 1 is modelled as gathering each layer's weights for "
                         "every micro-batch; torchtitan's default with pipelining keeps them "
                         "gathered from the forward to the backward pass instead (fewer gathers, "
                         "more memory), and DeepSpeed's pipeline engine does not run ZeRO-3")
        if v["sp"][i] > 0 and tp == 1:
            notes.append("sequence parallelism has no effect with tp = 1 (nothing to split the "
                         "sequence over; Megatron-LM turns it off)")
        out.append(notes)
    return out


def utilisation_notes(mfu: float, hfu: float, flash_attention: float) -> list[str]:
    """What an MFU or HFU above 100 % means, for one report (none at or below 100 %).

    Model FLOPs (the MFU numerator) follow Megatron's convention: the full s x s attention
    product, and a backward pass of twice the forward. The GEMMs and an unfused attention do
    exactly that work at most at the tensor peak, so they cannot pass 100 %; a causal flash
    kernel computes only the unmasked half of the product (with a 2.5x backward), so where
    attention dominates (long sequences) and its kernel runs near the peak the counted FLOPs
    exceed the work done, and the ratio to the peak can pass 100 %. Without flash attention an
    MFU above 100 % would mean the count and the modelled rates disagree: a defect."""
    worst = max(mfu, hfu)
    if not worst > 1.0:
        return []
    if flash_attention > 0:
        return [f"MFU / HFU above 100 % ({worst:.0%}): model FLOPs count the full s x s "
                "attention product (Megatron's convention), while the causal flash kernel "
                "computes only its unmasked half; at this sequence length attention dominates "
                "the step. The time is the model's; the utilisation is the convention's count"]
    return [f"MFU / HFU above 100 % ({worst:.0%}) without flash attention: the FLOP count "
            "and the modelled rates disagree; please report this configuration"]


def training_notes(model: Transformer, plan: TrainingPlan) -> list[str]:
    """The caveats of one configuration (scalar leaves): one sentence each, none if none."""
    return training_notes_batch(model, plan)[0]
