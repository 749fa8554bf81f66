# %% [markdown]
# # Inference: GEMM-level boundedness and DRAM scaling
#
# Llama-2 70B served with tensor parallelism 4, batch 1, a 2,048-token prompt and 128 output
# tokens, on A100, H100 and B200. Which operations are compute-bound, which memory-bound, and
# what does faster HBM buy?

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

import diffperf as dp
from diffperf.inference import bound_shares

model = dp.model("llama2-70b")
plan = dp.InferencePlan(tp=4, batch=1, input_len=2048, output_len=128)
tables = {}
for gpu in ("a100-sxm4-80gb", "h100-sxm5-80gb", "b200"):
    tables[gpu] = dp.boundedness(model, dp.system(gpu), plan)
gemms = ["qkv_proj", "out_proj", "mlp_up", "mlp_down", "attention", "tp_allreduce"]
summary = pd.concat({g: t[t["op"].isin(gemms)].set_index(["phase", "op"])[
    ["intensity", "machine_balance", "bound", "share"]] for g, t in tables.items()})
summary.round(3)

# %% [markdown]
# Prefill GEMMs have an arithmetic intensity far above the machine balance: compute-bound.
# Decode GEMMs (M = batch = 1) have an intensity of about 1 FLOP/B: memory-bound, streaming the
# weights once per token.

# %%
bound = {g: bound_shares(t) for g, t in tables.items()}
pd.concat(bound).round(2)

# %%
dp.roofline_plot(tables["h100-sxm5-80gb"], "figures/05_roofline_h100.png",
                 system=dp.system("h100-sxm5-80gb"), title="Llama-2 70B, TP 4, H100")

# %% [markdown]
# ## DRAM scaling
# Decode latency against HBM generation (same GPU otherwise, H100, TP 8, batch 1, 200 / 200).

# %%
scaling = dp.dram_scaling(model, dp.system("h100-sxm5-80gb"),
                          dp.InferencePlan(tp=8, batch=1, input_len=200, output_len=200))
print(scaling.round(4).to_string())
fig, ax = plt.subplots(figsize=(6.5, 3.8))
ax.plot(scaling["hbm_bandwidth"] / 1e12, scaling["tpot_s"] * 1e3, "o-")
for _, r in scaling.iterrows():
    ax.annotate(r["memory"].split(" (")[0], (r["hbm_bandwidth"] / 1e12, r["tpot_s"] * 1e3),
                fontsize=8, xytext=(4, 4), textcoords="offset points")
ax.set_xlabel("HBM bandwidth per GPU (TB/s)")
ax.set_ylabel("time per output token (ms)")
ax.set_title("Llama-2 70B decode, TP 8, batch 1 (H100 otherwise)")
fig.tight_layout()
fig.savefig("figures/05_dram_scaling.png", dpi=110)

# %% [markdown]
# **Finding.** Decode is memory-bound on every GPU, but at batch 1 the fixed per-kernel launch
# cost and the latency of two all-reduces per layer do not scale with HBM: going from HBM2e to
# HBM4 (6.5x the bandwidth) cuts the time per token by well under 2x.
