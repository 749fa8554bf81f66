"""Which KV-cache dtype a serving engine keeps by default.

vLLM's `--kv-cache-dtype auto` "will use model data type" (vllm/config/cache.py,
`CacheConfig.cache_dtype`), and SGLang's option is documented in the same words: with FP8 or
FP4 weights the model's data type is that of its activations, bf16, so the cache stays 16 bit
unless an FP8 cache is asked for. TensorRT-LLM follows the checkpoint instead: a ModelOpt
FP8 / NVFP4 checkpoint's `kv_cache_quant_algo` gives an FP8 cache (NVIDIA's own tables), a
checkpoint without one a bf16 cache.
"""

from __future__ import annotations

#: Engine presets (name prefixes) whose default KV cache is the model's own dtype.
MODEL_DTYPE_KV_ENGINES = ("vllm", "sglang")


def keeps_model_dtype_kv(engine_name: str, precision: str) -> bool:
    """True when `engine_name`'s preset keeps a bf16 KV cache by default although its GEMMs
    run at `precision` (fp8 or fp4 on a vLLM or SGLang preset, module docstring)."""
    return (precision.lower() in ("fp8", "fp4")
            and engine_name.lower().startswith(MODEL_DTYPE_KV_ENGINES))
