"""Parallel training plans. Categorical choices are integer codes so sweeps can batch them."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .._checks import (
    check_choice,
    check_fraction,
    check_integer,
    named_code,
    names_number_fields,
    number_field as _F,
)
from ._hardware import PRECISION_CODES, PRECISIONS

RECOMPUTE = {0: "none", 1: "selective", 2: "full"}
RECOMPUTE_CODES = {v: k for k, v in RECOMPUTE.items()}
#: Megatron-core's selective `recompute_modules` the plan can name, with their plan field
#: ("core_attn", the attention core, is `recompute` = selective).
RECOMPUTE_MODULES = {"layernorm": "recompute_norms", "moe_act": "recompute_moe_act",
                     "mla_up_proj": "recompute_mla_up", "mlp": "recompute_mlp"}
ZERO = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
ZERO_CODES = {v: k for k, v in ZERO.items()}


def _code(table: dict[str, int], field: str):
    return named_code("TrainingPlan", field, table)


def layer_count_error(layers: float, pp: float, vp: float, full_recompute: bool,
                      recompute_layers: float, offload_layers: float, name=str) -> str | None:
    """Why `recompute_layers` / `offload_layers` do not fit the layout, or None: each counts
    layers of one pipeline chunk (layers / (pp * vp)), and full recompute leaves no stored
    activations to offload. `name` spells a field for the message (a CLI flag, a CSV column)."""
    chunk = layers / (pp * vp)
    for field, n in (("recompute_layers", recompute_layers), ("offload_layers", offload_layers)):
        if n > chunk:
            return (f"{name(field)} {n:g} exceeds the layers per pipeline chunk "
                    f"(layers / (pp * vp) = {chunk:g})")
    if offload_layers > 0 and full_recompute:
        return (f"{name('offload_layers')} {offload_layers:g} has no effect with "
                f"{name('recompute')} full (no stored activations to offload)")
    return None


@names_number_fields
class TrainingPlan(eqx.Module):
    """How one training job is parallelised and run.

    Ranks are ordered tensor-parallel innermost, then context, data, pipeline parallel outermost
    (Megatron's order). The expert layers of a MoE model regroup the tp * cp * dp ranks of a
    stage as expert-tensor x expert x expert-data parallel, innermost first (Megatron-core's
    "MoE parallel folding"): experts are sharded over `ep` ranks spaced `expert_tp` apart.

    **Arguments:**

    - `tp`, `pp`, `dp`, `cp`, `ep`: tensor / pipeline / data / context / expert parallel degrees.
      The job uses tp * pp * dp * cp GPUs.
    - `expert_tp`: tensor-parallel degree of the expert MLPs (Megatron-core's
      `expert_tensor_parallel_size`); 0 (the default) = `tp`, Megatron-core's default. With
      `expert_tp` < `tp` (NVIDIA's MoE recipes use 1) each rank dispatches only its own
      sequence-parallel share of the tokens and `ep` may span tensor-parallel ranks:
      `ep * expert_tp` must divide `tp * cp * dp`. Modelled with sequence parallelism, which
      Megatron-core requires for MoE with tp > 1. Dense models ignore it.
    - `overlap_ep`: 1 to hide the expert-parallel all-to-alls behind the compute of another
      micro-batch (Megatron-core's `overlap_moe_expert_parallel_comm`, DeepSeek's DualPipe);
      0 (the default) runs them in line.
    - `fused_expert_gemm`: 1 if each grouped GEMM of the local experts is one kernel (a
      CUTLASS / cuBLASLt grouped GEMM, DeepSeek's DeepGEMM); 0 (the default) if it launches one
      GEMM per local expert, as Transformer Engine's `GroupedLinear` behind Megatron-core's
      grouped-GEMM expert MLP does (its multi-stream cuBLAS backend).
    - `micro_batch`: sequences per micro-batch.
    - `global_batch`: sequences per optimizer step (divisible by dp * micro_batch).
    - `vp`: interleaved pipeline chunks per stage (1 = plain 1F1B).
    - `sequence_parallel`: 1 to shard norms / dropout over the TP group (Korthikanti et al.),
      turning each TP all-reduce into reduce-scatter + all-gather.
    - `recompute`: 0 none, 1 selective (attention core), 2 full (whole layer); or the name.
    - `zero`: 0 plain data parallel, 1 sharded optimizer (distributed optimizer), 2 + sharded
      gradients, 3 + sharded parameters (FSDP).
    - `precision`: GEMM precision code 0 fp32/tf32, 1 bf16/fp16, 2 fp8, 3 fp4; or the name.
    - `flash_attention`: 1 for a fused attention kernel that never writes the s x s scores.
    - `overlap_tp`: 1 to overlap TP communication with GEMMs (fraction `Efficiency.tp_overlap`).
    - `overlap_tp_backward`: 1 to reduce each column-parallel layer's input gradient while its
      weight-gradient GEMM runs (Megatron-LM's asynchronous TP all-reduce, used by Korthikanti
      et al. 2022 and every later Megatron / NeMo); 0 for the 2021 Megatron-LM of Narayanan
      et al., which reduced in line.
    - `overlap_dp`: 1 to overlap the gradient reduction with the backward pass.
    - `recompute_layers`: layers of each pipeline chunk (`layers / (pp * vp)`) whose whole
      forward pass is recomputed, the first ones of the chunk, while the others follow
      `recompute` (Megatron's `--recompute-method block --recompute-num-layers N`); 0 = none. With
      `recompute = full` every layer is recomputed whatever this says.
    - `offload_layers`: layers of each pipeline chunk whose stored activations are copied to host
      memory during the forward pass and back during the backward pass (Megatron-core's
      `cpu_offloading_num_layers`); at most the chunk's layers that are not fully recomputed.
      Each copy overlaps one layer's compute, over `Accelerator.host_bandwidth`.
    - `offload_optimizer`: share of the optimizer states (fp32 master weights and Adam
      moments) kept in host memory and stepped by the CPU, 0 to 1 (ZeRO-Offload, DeepSpeed's
      `offload_optimizer` = 1; Megatron-core's `--optimizer-cpu-offload` with
      `--optimizer-offload-fraction`). Each step the gradients of that share go to the host,
      the CPU runs Adam on them, and the updated 16-bit weights come back, pipelined with the
      GPU's step of the rest (`diffperf.training._offload`).
    - `offload_weights`: 1 to keep the GPU's 16-bit weights (its ZeRO-3 shard, else all its
      local weights) in host memory and copy each layer's in before every pass that uses it,
      prefetched during the previous layer's compute (ZeRO-Infinity's `offload_param`,
      Megatron-core's `cpu_offloading_weights`); 0 (the default) keeps them in HBM.
    - `fp32_gradients`: 1 to accumulate and reduce gradients in an fp32 buffer (Megatron-LM's
      `main_grad`, which it forces for bf16 training); 0 for 16-bit gradients (Megatron-LM's
      default for fp16; NeMo and Megatron-Bridge performance recipes set
      `grad_reduce_in_fp32=False`; PyTorch DDP and DeepSpeed reduce in the parameters' dtype):
      half the gradient memory and data-parallel gradient traffic. fp32 training always keeps
      fp32 gradients.
    - `fp32_optimizer_moments`: 1 for fp32 Adam moments (`exp_avg`, `exp_avg_sq`); 0 for bf16
      moments (Megatron-core's precision-aware optimizer, `--exp-avg-dtype bf16
      --exp-avg-sq-dtype bf16`; the fp32 master weights stay): optimizer state 8 instead of 12 B
      per parameter, and less optimizer-step traffic. fp32 training always keeps fp32 moments.
    - `account_embedding_loss`: 1 to count the input embedding and the LM head + loss as one
      layer each when splitting the layers over pipeline chunks (Megatron's
      `account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split`, used by
      NVIDIA's Llama-3.1 405B recipes): layers + 2 slots over pp * vp chunks, so the first and
      the last chunk each hold one transformer layer fewer. No effect with pp = 1.
    - `recompute_norms`, `recompute_moe_act`, `recompute_mla_up`, `recompute_mlp`: 1 to discard
      a module's output in the forward pass and rerun the module before the backward pass
      needs it (Megatron-core's selective `recompute_modules` "layernorm", "moe_act",
      "mla_up_proj", "mlp"; 0, the default, keeps the output): the layer norms that are
      modules of their own (with Transformer Engine, MLA's input norm and a MoE layer's
      pre-MLP norm: the others are fused into the next linear layer and are not recomputed);
      the routed experts' activation (with its clamp, `Transformer.glu_clamp`); MLA's query
      and KV up-projections; the MLP of a dense model or of a MoE model's dense-MLP layers.
      Each trades its recomputed forward time for the outputs it no longer stores, on the
      layers that are not fully recomputed (`diffperf.training._layer.module_recompute_ops`,
      `_memory`). Megatron-core honours them with `recompute_granularity` selective; here
      they combine with any `recompute` (none = its selective mode without "core_attn").
    - `zero3_per_matrix`: ZeRO-3 collective granularity: 0 one transformer layer per gather /
      reduce-scatter (FSDP units: PyTorch FSDP, Megatron-FSDP), 1 one per weight matrix
      (DeepSpeed ZeRO-3 gathers parameter by parameter; biases and norms stay replicated). The
      DeepSpeed collectives are modelled as its 2021 runs behaved: 16-bit gradients, flat rings
      through each GPU's own NIC (`diffperf.costs.all_gather` with `striped = 0`).
    """

    tp: jax.Array = _F(default=1)
    pp: jax.Array = _F(default=1)
    dp: jax.Array = _F(default=1)
    cp: jax.Array = _F(default=1)
    ep: jax.Array = _F(default=1)
    micro_batch: jax.Array = _F(default=1)
    global_batch: jax.Array = _F(default=1)
    vp: jax.Array = _F(default=1)
    sequence_parallel: jax.Array = _F(default=0)
    recompute: jax.Array = eqx.field(converter=_code(RECOMPUTE_CODES, "recompute"), default=0)
    zero: jax.Array = eqx.field(converter=_code(ZERO_CODES, "zero"), default=1)
    precision: jax.Array = eqx.field(converter=_code(PRECISION_CODES, "precision"), default=1)
    flash_attention: jax.Array = _F(default=1)
    overlap_tp: jax.Array = _F(default=1)
    overlap_tp_backward: jax.Array = _F(default=1)
    overlap_dp: jax.Array = _F(default=1)
    zero3_per_matrix: jax.Array = _F(default=0)
    recompute_layers: jax.Array = _F(default=0)
    fp32_gradients: jax.Array = _F(default=1)
    account_embedding_loss: jax.Array = _F(default=0)
    offload_layers: jax.Array = _F(default=0)
    fp32_optimizer_moments: jax.Array = _F(default=1)
    expert_tp: jax.Array = _F(default=0)
    overlap_ep: jax.Array = _F(default=0)
    fused_expert_gemm: jax.Array = _F(default=0)
    offload_optimizer: jax.Array = _F(default=0)
    offload_weights: jax.Array = _F(default=0)
    recompute_norms: jax.Array = _F(default=0)
    recompute_moe_act: jax.Array = _F(default=0)
    recompute_mla_up: jax.Array = _F(default=0)
    recompute_mlp: jax.Array = _F(default=0)

    def __check_init__(self):
        for name in ("tp", "pp", "dp", "cp", "ep", "micro_batch", "global_batch", "vp"):
            check_integer("TrainingPlan", name, getattr(self, name))
        check_integer("TrainingPlan", "expert_tp", self.expert_tp, minimum=0)
        for name in ("sequence_parallel", "flash_attention", "overlap_tp", "overlap_tp_backward",
                     "overlap_dp", "zero3_per_matrix", "fp32_gradients", "account_embedding_loss",
                     "fp32_optimizer_moments", "overlap_ep", "fused_expert_gemm",
                     "offload_weights", *RECOMPUTE_MODULES.values()):
            check_choice("TrainingPlan", name, getattr(self, name), {0: "off", 1: "on"})
        check_choice("TrainingPlan", "recompute", self.recompute, RECOMPUTE)
        for name in ("recompute_layers", "offload_layers"):
            check_integer("TrainingPlan", name, getattr(self, name), minimum=0)
        check_fraction("TrainingPlan", "offload_optimizer", self.offload_optimizer)
        check_choice("TrainingPlan", "zero", self.zero, ZERO)
        check_choice("TrainingPlan", "precision", self.precision, PRECISIONS)

    @property
    def num_gpus(self) -> jax.Array:
        """GPUs in the job, tp * pp * dp * cp."""
        return self.tp * self.pp * self.dp * self.cp

    def expert_layout(self, model) -> tuple[jax.Array, jax.Array]:
        """(etp, edp): the expert MLPs' tensor-parallel degree (`expert_tp`, or `tp` when it is
        0 or the model is dense) and their data-parallel degree tp * cp * dp / (etp * ep), the
        ranks that hold the same experts and reduce their gradients."""
        etp = jnp.where((self.expert_tp > 0) & (model.num_experts > 1), self.expert_tp, self.tp)
        return etp, self.tp * self.cp * self.dp / (etp * self.ep)

    @property
    def num_micro_batches(self) -> jax.Array:
        """Micro-batches per step per pipeline, global_batch / (dp * micro_batch)."""
        return self.global_batch / (self.dp * self.micro_batch)

    @property
    def gradient_bytes(self) -> jax.Array:
        """Bytes per gradient element held and reduced: 4 (fp32 buffer or fp32 training) or 2."""
        return jnp.where((self.fp32_gradients > 0) | (self.precision == 0), 4.0, 2.0)

    @property
    def optimizer_state_bytes(self) -> jax.Array:
        """Optimizer state bytes per parameter: fp32 master weights + two Adam moments, 12 (8
        with bf16 moments, `fp32_optimizer_moments = 0`); fp32 training keeps only the two fp32
        moments (its weights are the master copy): 8."""
        moment = jnp.where((self.fp32_optimizer_moments > 0) | (self.precision == 0), 4.0, 2.0)
        return jnp.where(self.precision == 0, 0.0, 4.0) + 2.0 * moment

    def _split_slots(self) -> jax.Array:
        """True where the embedding and the loss each take one layer slot of the split."""
        return (self.account_embedding_loss > 0) & (self.pp > 1)

    def pipeline_slots(self, layers) -> jax.Array:
        """Layer slots the pipeline split divides: the transformer layers, plus the embedding
        and the loss (one slot each) with `account_embedding_loss` and pp > 1."""
        return layers + jnp.where(self._split_slots(), 2.0, 0.0)

    def end_stage_layers(self, layers) -> jax.Array:
        """Transformer layers on the first (and on the last) pipeline stage: layers / pp, or
        (layers + 2) / pp - 1 with `account_embedding_loss`."""
        return jnp.where(self._split_slots(), (layers + 2.0) / self.pp - 1.0, layers / self.pp)

    def middle_stage_layers(self, layers) -> jax.Array:
        """Transformer layers on a middle pipeline stage (as many as an end stage when pp < 3
        or without `account_embedding_loss`)."""
        return jnp.where(self._split_slots() & (self.pp > 2), (layers + 2.0) / self.pp,
                         self.end_stage_layers(layers))

    def chunk_layers(self, layers) -> jax.Array:
        """Transformer layers in one pipeline chunk, layers / (pp * vp) (fractional when uneven)."""
        return layers / (self.pp * self.vp)

    def recomputed_fraction(self, layers) -> jax.Array:
        """Fraction of the layers whose whole forward pass is recomputed: 1 with full
        recompute, else min(recompute_layers, chunk layers) / chunk layers."""
        chunk = self.chunk_layers(layers)
        block = jnp.minimum(self.recompute_layers, chunk) / chunk
        return jnp.where(self.recompute == 2, 1.0, block)

    def offloaded_fraction(self, layers) -> jax.Array:
        """Fraction of the layers whose activations live in host memory: the offloaded layers
        of each chunk that are not fully recomputed, over the chunk's layers."""
        chunk = self.chunk_layers(layers)
        kept = chunk * (1.0 - self.recomputed_fraction(layers))
        return jnp.minimum(self.offload_layers, kept) / chunk
