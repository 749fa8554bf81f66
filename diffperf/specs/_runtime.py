"""The software runtime of a job: how much host (CPU) time it spends issuing the work, and the
few kernel choices of its software that the model's other inputs do not fix.

The host issues kernels and collectives asynchronously. While the GPU's work per operator is
long, the GPU never waits; when it is short (small models, high tensor parallelism, small
micro-batches), the GPU waits for the host, and a layer takes about the longer of the two
streams (`diffperf.training.host_wait`). An eager framework spends microseconds to tens of
microseconds of CPU per operator (Python, the dispatcher, autograd recording, the launch
itself); a CUDA graph replays a whole captured step for a few microseconds in all, and the GPU
then starts each captured kernel about half a microsecond after the previous one.
"""

from __future__ import annotations

import equinox as eqx
import jax

from .._checks import (
    check_at_least,
    check_fraction,
    check_nonnegative,
    check_positive,
    names_number_fields,
    number_field as _F,
)


@names_number_fields
class Runtime(eqx.Module):
    """Host-side costs of the software stack that runs a training step or serves a model.
    Every field is a differentiable leaf (vmap / grad over runtimes works as over hardware).

    **Arguments:**

    - `host_op_time`: host time to issue one framework-level operator of the forward pass
      (Python, dispatcher, autograd recording, kernel launch), s.
    - `host_backward_op_time`: host time of one operator the autograd engine runs in the
      backward pass, s.
    - `host_collective_time`: host time to issue one collective (process group call, NCCL
      enqueue), s.
    - `ops_per_layer`: framework operators issued by one transformer layer's forward pass
      (including views and reshapes, which cost host time but launch no kernel), count.
    - `backward_ops_per_op`: backward operators per forward operator, ratio.
    - `train_graph`: 1 if the training step is captured in a CUDA graph (its replay costs the
      host nothing per operator), 0 for eager execution.
    - `prefill_graph`, `decode_graph`: 1 if a serving engine captures its prefill / decode step
      in a CUDA graph: the host issues no operator, and each kernel costs `graph_node_time`
      instead of the accelerator's `launch_overhead` (`diffperf.inference.host_wait`).
    - `graph_node_time`: GPU-side gap between two kernels of a replayed CUDA graph, s.
    - `graph_max_tokens`: largest pass (tokens: the batch in decode, batch x prompt in prefill)
      the engine has captured a graph for; larger passes run eagerly, count.
    - `graph_pad_ratio`, `graph_pad_from`: CUDA-graph padding of a decode step. An engine that
      captures graphs for a ladder of batch sizes and pads (TensorRT-LLM's
      `cuda_graph_config.enable_padding`) runs a decode batch of b sequences as the next
      captured size: above `graph_pad_from` (tokens) the ladder grows by `graph_pad_ratio`, and
      `graph_max_tokens` is its top (`diffperf.inference.graph_padded_batch`). The padded
      rows' weight GEMMs, element-wise kernels and LM head run over empty slots; their
      attention reads no cache. Ratio 1 (the default): no padding.
    - `host_step_time`: host time per serving step outside the layers (scheduler, sampling,
      detokenisation, input preparation), s; CUDA graphs do not remove it.
    - `elementwise_kernels`: element-wise kernels one layer launches per inference pass (norms,
      residual adds, activation; RoPE and the KV-cache write are fused into attention), count:
      4 with TensorRT-LLM-style fusion, more in an unfused eager model.
    - `micro_batch_ops`: framework operators a training micro-batch issues outside the
      transformer layers, forward and backward together (embedding, final norm, LM head, loss,
      loss averaging, the training engine's wrappers; a small collective counts as one), each
      at `host_op_time`, count.
    - `input_ops`: operators (or their host-time equivalent) that fetch and prepare one
      training micro-batch's inputs (data iterator, broadcast over the TP group, masks and
      position ids), each at `host_op_time`, count.
    - `pass_sync`: 1 if the framework synchronises the device around the input preparation and
      at the start and end of every micro-batch's forward and backward pass (Megatron's
      timers call `torch.cuda.synchronize()`), so the host cannot run ahead across them; 0 if
      it runs ahead through the step; in [0, 1] (`micro_batch_host_wait` in
      diffperf/training/_host.py).
    - `moe_ops_per_layer`: framework operators a MoE layer's forward issues on top of
      `ops_per_layer` (router, token dispatcher, permutation, combine, the grouped GEMMs'
      fixed calls; training), count; in the share of the layers that have experts.
    - `moe_ops_per_expert`: more forward operators per local expert of a MoE layer (the
      grouped linear layers' per-expert splits, casts and GEMM calls), count.
    - `moe_layer_sync`: 1 if every MoE layer's forward waits on the host for a device value
      (Megatron-Core's dropless all-to-all dispatcher copies the tokens per expert to the host
      before the all-to-all): the host cannot run ahead from a layer's forward into its
      backward, so the forward and backward passes of the layers are separate segments, as
      with `pass_sync`; in [0, 1].
    - `host_seq_time`: host time per running sequence per serving step (a Python engine's
      request bookkeeping, sampler update and response handling: the TensorRT-LLM PyTorch
      executor's per-request loop in `TorchSampler.update_requests`, vLLM's output
      processing), s. It runs beside the GPU (the engines look one step ahead), so it binds
      only when a step's sequences take the host longer than the GPU takes for the step:
      the host's issue stream of the step grows by (sequences x `host_seq_time`).
    - `fp8_prefill_attention`: 1 if the engine runs its prefill (context) attention kernel
      in FP8 when the KV cache is stored in 8 bits or fewer (TensorRT-LLM's FP8 context FMHA),
      0 if it runs in 16 bit whatever the cache; in [0, 1] (the share of the prefill attention
      work run in FP8). A kernel choice of the software, not a host cost; it acts only on GPUs
      with FP8 tensor cores (`diffperf.costs.fused_attention_rate`).
    - `moe_gemm_time_factor`: time of the routed experts' grouped GEMMs (both their compute and
      their memory time) relative to the model's, ratio (1, the default: kernels that reach
      the model's rates, as TensorRT-LLM's TRTLLM-Gen MoE backend does). A what-if for a
      slower MoE kernel backend; no preset sets it (no law of the expert shape reproduces the
      measured slowdowns of TensorRT-LLM's CUTLASS backend, which `moe_gemm_table` reads per
      shape instead; docs/accuracy.md). It acts on the routed experts of MoE models only.
    - `custom_allreduce`: 1 if the engine's tensor-parallel all-reduce inside an NVLink domain
      runs its own one-shot / two-shot peer-to-peer kernels for small messages and NCCL for
      large ones (TensorRT-LLM's `AllReduceStrategy.AUTO`, vLLM's and SGLang's custom
      all-reduce), 0 if every all-reduce is NCCL's ring; in [0, 1]
      (`diffperf.costs.engine_all_reduce`: a 16-KB all-reduce over 8 H100s measured at 3.7-5.2
      us, where the model's NCCL ring charges about 20), for groups of 2-8 GPUs. Inference and
      serving only (not the attention-data-parallel MoE gather); training always uses NCCL.
    - `moe_permute_copy`: 1 if the engine copies each routed token row into its expert's
      contiguous block before the expert GEMMs (TensorRT-LLM's CUTLASS and DeepGEMM MoE
      backends, the default), 0 if the first expert GEMM gathers its rows by index (vLLM's
      and SGLang's Triton `fused_moe`); in [0, 1]. Both still pay the combine (read the routed
      rows, write the tokens). Inference and serving only
      (`moe_permute_cost` in diffperf/inference/_infer.py); training counts Megatron's
      permutation itself. The TensorRT-LLM presets keep 1, the CUTLASS backend's default through
      1.x; its TRTLLM-Gen backend (gpt-oss on Blackwell where a row names it) and its Triton
      backend (gpt-oss on Hopper) gather inside the GEMM, which the presets do not separate.
    - `moe_gemm_table`: 1 if the engine's routed-expert GEMMs in 4-bit math (NVFP4 weights and
      activations) run at the speed NVIDIA measured for TensorRT-LLM's CUTLASS MoE backend on
      Blackwell, per expert shape and token count (`measured_gemm_factor` in
      diffperf/inference/_moe_gemm_factors.py: 2-3x the model's time for Qwen3-30B-A3B's
      768-wide experts, about 1.05x for DeepSeek-V3's; 1 for a shape the tables lack), 0 if at
      the model's rates; in [0, 1] (the factor is raised to it). The TensorRT-LLM
      PyTorch-backend presets set 1 (TensorRT-LLM 1.x's default MoE backend, `MoeConfig.backend`
      'CUTLASS'); its TRTLLM-Gen backend (gpt-oss, MXFP4 x MXFP8) and other precisions are
      not affected. Inference and serving only.

    The default (every host time 0, no graphs, fused element-wise kernels, NCCL's all-reduce)
    is the runtime of the calibration set (Megatron-Core / NeMo on large models; TensorRT-LLM
    0.x tables without CUDA graphs): its host never binds beyond the per-kernel launch the
    hardware model already charges, and predictions are those of the model without a host
    stream. Named presets: `diffperf.presets.runtime`.
    """

    host_op_time: jax.Array = _F(default=0.0)
    host_backward_op_time: jax.Array = _F(default=0.0)
    host_collective_time: jax.Array = _F(default=0.0)
    ops_per_layer: jax.Array = _F(default=40.0)
    backward_ops_per_op: jax.Array = _F(default=1.0)
    train_graph: jax.Array = _F(default=0.0)
    prefill_graph: jax.Array = _F(default=0.0)
    decode_graph: jax.Array = _F(default=0.0)
    graph_node_time: jax.Array = _F(default=0.5e-6)
    graph_max_tokens: jax.Array = _F(default=1e9)
    graph_pad_ratio: jax.Array = _F(default=1.0)
    graph_pad_from: jax.Array = _F(default=128.0)
    host_step_time: jax.Array = _F(default=0.0)
    elementwise_kernels: jax.Array = _F(default=4.0)
    micro_batch_ops: jax.Array = _F(default=0.0)
    input_ops: jax.Array = _F(default=0.0)
    pass_sync: jax.Array = _F(default=0.0)
    moe_ops_per_layer: jax.Array = _F(default=0.0)
    moe_ops_per_expert: jax.Array = _F(default=0.0)
    moe_layer_sync: jax.Array = _F(default=0.0)
    host_seq_time: jax.Array = _F(default=0.0)
    fp8_prefill_attention: jax.Array = _F(default=0.0)
    moe_gemm_time_factor: jax.Array = _F(default=1.0)
    custom_allreduce: jax.Array = _F(default=0.0)
    moe_permute_copy: jax.Array = _F(default=1.0)
    moe_gemm_table: jax.Array = _F(default=0.0)

    def __check_init__(self):
        for name in ("host_op_time", "host_backward_op_time", "host_collective_time",
                     "ops_per_layer", "backward_ops_per_op", "graph_node_time",
                     "graph_max_tokens", "host_step_time", "elementwise_kernels",
                     "micro_batch_ops", "input_ops", "moe_ops_per_layer",
                     "moe_ops_per_expert", "host_seq_time"):
            check_nonnegative("Runtime", name, getattr(self, name))
        check_positive("Runtime", "graph_pad_from", self.graph_pad_from)
        check_positive("Runtime", "moe_gemm_time_factor", self.moe_gemm_time_factor)
        check_at_least("Runtime", "graph_pad_ratio", self.graph_pad_ratio, 1.0)
        for name in ("train_graph", "prefill_graph", "decode_graph", "pass_sync",
                     "moe_layer_sync", "fp8_prefill_attention", "custom_allreduce",
                     "moe_permute_copy", "moe_gemm_table"):
            check_fraction("Runtime", name, getattr(self, name))
