"""Measured speed of one MoE kernel library's routed-expert GEMMs, as a factor on the model's.

The model costs a routed expert's grouped GEMMs at the rates a well-tuned kernel reaches. One
backend does not: TensorRT-LLM's CUTLASS MoE backend in NVFP4 (block-scaled 4-bit weights and
activations) on Blackwell takes 2-3x the model's time for Qwen3-30B-A3B's 768-wide experts,
1.2-2x for Qwen3-235B-A22B's 1,536-wide ones and about 1.05x for DeepSeek-V3's 2,048-wide ones
at 256-4,096 tokens, in NVIDIA's own
measured database (AIConfigurator's TensorRT-LLM 1.3.0rc20 MoE tables). The slowdown follows
the tactics the kernel library picks per shape, not a law of the shape that those tables
support (calibration/EXPERIMENTS.md, "NVIDIA's measured TensorRT-LLM MoE database"), so it is
read from the tables where the shape was measured:

    t_experts = g(H, I / moe_tp, E, k; T) * t_experts(model),

g the factor at which the model's module equals the measured one (`calibration/
moe_gemm_tables.py` solves it per expert shape and token count; `diffperf/presets/
moe_gemm_factors.json` holds log g on the tables' 27 token counts, the median of B200's, GB200's,
B300's and GB300's), interpolated linearly in log g over log T (T: the tokens entering the layer's
experts on one GPU; held flat beyond the grid) and 1 where the shape (hidden H, per-GPU expert
width I / moe_tp, experts E, top-k k) is not in the tables. A runtime asks for it with
`Runtime.moe_gemm_table` (the TensorRT-LLM presets), and it acts only on 4-bit-math expert GEMMs
(NVFP4 weights and activations) of GPUs with FP4 tensor cores.

It is a lookup, not a law: exact on the measured shapes, silent (1) elsewhere; its gradient
with respect to the shape is zero and with respect to T follows the table. The four GPUs'
tables mostly agree within 10 % up to about 1,000 tokens; B200's runs 1.5-2x the others for
four shapes (Qwen3-235B-A22B's, Llama 4 Scout's and Maverick's, one 6,144-wide one: the
autotuner's tactic choices), and at 4,096+ tokens B300 / GB300's g is up to 1.6x B200 /
GB200's (their 1.5x FP4 peak is not realised; `gpu_spread` in the JSON); the median does not
resolve that.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

#: The shipped table (written by calibration/moe_gemm_tables.py).
FACTORS_JSON = Path(__file__).resolve().parent.parent / "presets" / "moe_gemm_factors.json"
#: The token counts of NVIDIA's MoE tables (tokens entering the module on one GPU).
TOKEN_GRID = np.array([1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512,
                       768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384], float)


@functools.lru_cache(maxsize=1)
def _table() -> tuple[np.ndarray, np.ndarray]:
    """(keys [N, 4]: hidden, per-GPU expert width, experts, top-k; log g [N, 27])."""
    data = json.loads(FACTORS_JSON.read_text())
    if data["token_grid"] != [int(t) for t in TOKEN_GRID]:
        raise ValueError(f"{FACTORS_JSON}: token_grid differs from TOKEN_GRID")
    e = data["entries"]
    keys = np.array([[x["hidden"], x["expert_width"], x["num_experts"], x["top_k"]] for x in e],
                    float)
    return keys, np.array([x["log_factor"] for x in e], float)


def measured_gemm_factor(hidden, expert_width, num_experts, top_k, tokens) -> jax.Array:
    """g of the module docstring for one GPU's expert shape (hidden, per-GPU expert width,
    experts, top-k) and `tokens` entering its experts, ratio (1 where the shape was not
    measured; where several entries shared a shape, the mean of their log g: the shipped table
    has none, `tests/test_moe_gemm_factors.py`). Pure JAX; the arguments broadcast together."""
    keys, logs = _table()
    f = jnp.result_type(float)
    *shape, log_t = jnp.broadcast_arrays(
        *(jnp.asarray(v, f) for v in (hidden, expert_width, num_experts, top_k)),
        jnp.log(jnp.clip(jnp.asarray(tokens, f), 1.0, None)))
    lead = (1,) * log_t.ndim
    match = jnp.ones(log_t.shape + (len(keys),), bool)
    for j, v in enumerate(shape):
        match &= jnp.abs(v[..., None] - jnp.asarray(keys[:, j], f).reshape(lead + (-1,))) < 0.5
    hits = jnp.sum(match, axis=-1, keepdims=True).astype(f)
    # the matching entries' mean log-factor curve, then one interpolation over log tokens
    curve = (match.astype(f) / jnp.maximum(hits, 1.0)) @ jnp.asarray(logs, f)
    grid = jnp.log(jnp.asarray(TOKEN_GRID, f))
    flat = jax.vmap(lambda t, c: jnp.interp(t, grid, c))(log_t.reshape(-1),
                                                         curve.reshape(-1, grid.size))
    return jnp.exp(flat.reshape(log_t.shape))
