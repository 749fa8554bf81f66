"""Caveats of a concrete training plan that is valid but modelled with a simplification: an
uneven pipeline layout, offloading Megatron-core does not run, ZeRO-3 with pipelining, sequence
parallelism without tensor parallelism. `diffperf train` prints them as notes; `diffperf
predict` adds them to a row's status."""

from __future__ import annotations

from .model import Transformer
from .plans import TrainingPlan


def training_notes(model: Transformer, plan: TrainingPlan) -> list[str]:
    """One sentence per caveat of `plan` (scalar leaves); empty when there is none."""
    from .search import even_layout, offload_supported
    tp, pp, vp = (float(plan.tp), float(plan.pp), float(plan.vp))
    notes = []
    if not bool(even_layout(model, plan)):
        layers, chunks = float(model.layers), pp * vp
        slots = f"{layers:g} layers"
        if float(plan.account_embedding_loss) > 0 and pp > 1:
            layers += 2.0  # the embedding and the loss take one slot each
            slots = f"{layers:g} slots ({layers - 2:g} layers + embedding + loss)"
        notes.append(f"uneven layout: {slots} over pp*vp = {chunks:g} stages/chunks "
                     f"({layers / chunks:.2f} each) needs a custom pipeline layout; modelled as "
                     f"perfectly balanced (optimistic when the per-GPU layer counts differ)")
    if not bool(offload_supported(model, plan)):
        notes.append("Megatron-core offloads activations only with pp = 1, no recomputation and "
                     "fewer layers than the model has; modelled anyway")
    if float(plan.zero) == 3 and pp > 1:
        notes.append("ZeRO-3 with pp > 1 is modelled as gathering each layer's weights for every "
                     "micro-batch; torchtitan's default with pipelining keeps them gathered from "
                     "the forward to the backward pass instead (fewer gathers, more memory), and "
                     "DeepSpeed's pipeline engine does not run ZeRO-3")
    if float(plan.sequence_parallel) > 0 and tp == 1:
        notes.append("sequence parallelism has no effect with tp = 1 (nothing to split the "
                     "sequence over; Megatron-LM turns it off)")
    return notes
