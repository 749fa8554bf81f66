"""How one inference (serving) job is run: parallelism, batch, lengths and precisions."""

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
from ._hardware import (
    BYTES_PER_ELEMENT,
    INTEGER_WEIGHTS,
    PRECISION_CODES,
    PRECISIONS,
    weight_scale_block,
)


def _precision(field: str, extra: dict | None = None):
    """Converter accepting a precision name ('bf16', 'fp8', ...; `extra` names too) or an
    integer code."""
    names = {**PRECISION_CODES, **(extra or {})}

    return named_code("InferencePlan", field, names)


@names_number_fields
class InferencePlan(eqx.Module):
    """A static-batch serving run: `batch` requests of `input_len` prompt tokens each generate
    `output_len` tokens on a `tp` x `pp` GPU group.

    **Arguments:**

    - `tp`, `pp`: tensor / pipeline parallel degrees (the job uses tp * pp GPUs).
    - `ep`: expert-parallel degree of a MoE model's expert layers within the tp GPUs of a
      stage: the experts are split into `ep` groups of E / ep, and each expert's width over
      tp / ep GPUs (TensorRT-LLM's `moe_ep_size` x `moe_tp_size` = `tp_size`; 1 = every
      expert split over all tp GPUs). Attention stays tensor-parallel, so every GPU sees every
      token and the expert outputs are all-reduced as with ep = 1; what changes is that the
      GPU whose experts most tokens picked sets the pace (uniform routing, see
      `diffperf.inference.busiest_gpu_experts`). Must divide tp and the expert count.
    - `batch`: concurrent sequences, count.
    - `input_len`, `output_len`: prompt and generated tokens per sequence, count.
    - `weight_precision`: storage precision of the weights (code or name: fp32, bf16, fp8, fp4;
      int8 / int4 weight-only formats are costed as the bytes of fp8 / fp4, and with the
      default 16-bit `activation_precision` their GEMMs run in 16 bit).
    - `activation_precision`: precision of the GEMM inputs; the GEMMs run at the wider of the
      weight and activation precisions (e.g. fp4 weights with bf16 activations run bf16 math).
    - `kv_precision`: storage precision of the KV cache.
    - `flash_attention`: 1 for a fused prefill attention kernel that never writes the scores.
    - `grouped_decode_attention`: 1 for a decode attention kernel that serves all the query heads
      of a GQA group from one read of their KV head on tensor cores (FlashDecoding, FlashInfer,
      TensorRT-LLM XQA); 0 for one CUDA-core thread block per query head (TensorRT-LLM's masked
      MHA, which TensorRT-LLM <= 0.9 ran for multi-head attention and for every GQA group size
      without an XQA kernel): scalar FP32 dot products at `Efficiency.per_head_attention` of the
      CUDA-core FLOP/s, g times the work per K/V byte for g query heads per KV head (the L2
      serves a group's repeated K/V reads).
    - `gemm_peak_fraction`: the share of the GPU's tensor-core peak that the layers' weight
      GEMM kernels can issue, set by the instruction they are built on, not an efficiency
      (default 1: kernels native to the GPU). Ampere-generation kernels (`mma.sync`) on Hopper
      reach about 2/3 of its peak, which needs `wgmma` (the FlashAttention-3 authors, citing
      Luo et al., arXiv:2402.13499): TensorRT-LLM <= 0.9's weight-only and MoE GEMMs, Marlin.
      Applies to the attention projections and the MLP / expert GEMMs, not to the router,
      the LM head or attention itself.
    - `prefill_tokens`: the most prompt tokens one forward pass processes, count (chunked
      prefill: TensorRT-LLM's `max_num_tokens`, vLLM's `max_num_batched_tokens`); 0 = the whole
      batch's prompts at once. It bounds the prefill activations in `diffperf.inference_memory`
      (and so `max_batch`); the time model keeps one pass over all prompt tokens (the FLOPs
      and bytes are the same; the smaller GEMMs of a chunk are not costed).
    - `attention_dp`: 1 to run attention data-parallel over the `tp` GPUs of a stage
      (TensorRT-LLM's `enable_attention_dp`, SGLang's `--enable-dp-attention`; "DEP" with
      `ep = tp`): each GPU serves its own share of the sequences (batch / tp) with the whole
      attention block (every head, unsplit projections, its own KV cache: no KV head is
      replicated, which matters for MLA's single latent head), the LM head, dense-MLP layers and
      shared experts replicated; only the routed experts are split, `ep` groups of E / ep
      experts, each over tp / ep GPUs. Each MoE layer gathers the tokens of all tp GPUs to the
      experts and returns their outputs (an all-gather and a reduce-scatter of the gathered
      tokens: one all-reduce's traffic, TensorRT-LLM's attention-DP MoE communication), so the
      experts of a GPU see tp times its own tokens and no attention all-reduce remains. 0
      (default): attention tensor-parallel.
    - `weight_scale_block`: elements per 8-bit block scale of 4-bit (`fp4`) weights, count: 16
      for NVFP4, 32 for MXFP4 and group-wise int4 (4.25 bits; `specs.WEIGHT_SCALE_BLOCK`). The
      weights take 0.5 + 1 / block B per element; no effect on wider weights. Default (0): by
      the weights' name, 32 for `int4`, else 16.
    """

    tp: jax.Array = _F(default=1)
    pp: jax.Array = _F(default=1)
    batch: jax.Array = _F(default=1)
    input_len: jax.Array = _F(default=128)
    output_len: jax.Array = _F(default=128)
    weight_precision: jax.Array = eqx.field(
        converter=_precision("weight_precision",
                             {k: PRECISION_CODES[v] for k, v in INTEGER_WEIGHTS.items()}),
        default=1)
    activation_precision: jax.Array = eqx.field(converter=_precision("activation_precision"),
                                                default=1)
    kv_precision: jax.Array = eqx.field(converter=_precision("kv_precision"), default=1)
    flash_attention: jax.Array = _F(default=1)
    grouped_decode_attention: jax.Array = _F(default=1)
    gemm_peak_fraction: jax.Array = _F(default=1)
    ep: jax.Array = _F(default=1)  # after the others, so positional arguments keep their meaning
    prefill_tokens: jax.Array = _F(default=0)
    attention_dp: jax.Array = _F(default=0)
    weight_scale_block: jax.Array = _F(default=0)

    def __post_init__(self):
        # runs before the converters: `weight_precision` is still the name the caller gave
        if isinstance(self.weight_scale_block, (int, float)) and self.weight_scale_block == 0:
            self.weight_scale_block = weight_scale_block(str(self.weight_precision))

    def __check_init__(self):
        for name in ("tp", "pp", "ep", "batch", "input_len", "output_len"):
            check_integer("InferencePlan", name, getattr(self, name))
        check_integer("InferencePlan", "prefill_tokens", self.prefill_tokens, minimum=0)
        check_integer("InferencePlan", "weight_scale_block", self.weight_scale_block)
        for name in ("weight_precision", "activation_precision", "kv_precision"):
            check_choice("InferencePlan", name, getattr(self, name), PRECISIONS)
        check_choice("InferencePlan", "flash_attention", self.flash_attention, {0: "off", 1: "on"})
        check_choice("InferencePlan", "attention_dp", self.attention_dp, {0: "off", 1: "on"})
        check_choice("InferencePlan", "grouped_decode_attention", self.grouped_decode_attention,
                     {0: "off", 1: "on"})
        check_fraction("InferencePlan", "gemm_peak_fraction", self.gemm_peak_fraction,
                       allow_zero=False)

    @property
    def num_gpus(self) -> jax.Array:
        """GPUs in the job, tp * pp."""
        return self.tp * self.pp

    @property
    def attention_ranks(self) -> jax.Array:
        """Data-parallel attention ranks per stage: tp with `attention_dp`, else 1."""
        return jnp.where(self.attention_dp > 0, self.tp, 1.0)

    @property
    def attention_tp(self) -> jax.Array:
        """Tensor-parallel degree of the attention block (and of everything but the routed
        experts): 1 with `attention_dp`, else tp."""
        return jnp.where(self.attention_dp > 0, 1.0, self.tp)

    @property
    def weight_bytes(self) -> jax.Array:
        """Bytes per weight element: the weight precision's (`specs.BYTES_PER_ELEMENT`), and for
        4-bit weights their values and one 8-bit scale per `weight_scale_block`,
        0.5 + 1 / block, B."""
        b = jnp.asarray(BYTES_PER_ELEMENT)[jnp.clip(jnp.asarray(self.weight_precision), 0, 3)
                                           .astype(jnp.int32)]
        return jnp.where(self.weight_precision == 3, 0.5 + 1.0 / self.weight_scale_block, b)

    @property
    def math_precision(self) -> jax.Array:
        """Precision code of the GEMM arithmetic: the wider of weights and activations."""
        return jnp.minimum(self.weight_precision, self.activation_precision)
