# %% [markdown]
# # Technology nodes: 12 nm to 1 nm, and which bottleneck follows
#
# `diffperf.design.generate` builds an accelerator from a logic node, an HBM generation and a
# network generation (tables with sources in `presets/technology.json`, log-space interpolation,
# one fitted constant per architecture). Here one H100-class design (814 mm^2 die, 700 W,
# 6 HBM stacks, 36 NVLink lanes, Hopper architecture) is moved from 12 nm to 1 nm in four ways:
# only the logic node, only the memory, only the network, or all three together (each node with
# the HBM and NVLink generation of its year). Workloads: GPT-3 175B training on 1,024 GPUs
# (best of 1,680 candidate plans at every point, bf16) and Llama-2 70B decode (TP 8, batch 1,
# 128 in / 128 out). The bottleneck shares are minus the elasticities of the time with respect
# to each resource's rates (one `jax.grad` per point).

# %%
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from diffperf.design import node_study
from diffperf.internal import technology as T

t0 = time.perf_counter()
refs = pd.DataFrame(T.reference_table()).set_index("gpu")
print(f"reference designs generated in {time.perf_counter() - t0:.1f} s "
      f"(kappa per architecture: {T.calibrate_architectures()})")
refs[["flops_bf16_ratio", "hbm_bandwidth_ratio", "hbm_capacity_ratio",
      "nvlink_bandwidth_ratio", "freq_scale", "power_w", "cost_usd"]].round(3)

# %% [markdown]
# The generator reproduces the A100, H100 and B200 datasheets (FLOP/s exactly, since `kappa` is
# fitted to them; HBM and NVLink from the tables alone). This is a consistency check, not an
# independent validation.

# %%
t0 = time.perf_counter()
df = node_study()
print(f"{len(df)} points (4 scalings x {df['node_nm'].nunique()} nodes) in "
      f"{time.perf_counter() - t0:.1f} s")
df = df.astype({c: float for c in df.columns if df[c].dtype.kind == "f"})
wide = df.pivot(index="node_nm", columns="scaling", values=["train_step_s", "infer_tpot_ms"])
wide = wide.sort_index(ascending=False)
wide.round(2)

# %% [markdown]
# ## Bottleneck shares under full scaling

# %%
full = df[df["scaling"] == "full"].set_index("node_nm")
parts = ["compute", "memory", "network", "latency"]
shares = pd.concat({"train": full[[f"train_{p}" for p in parts]].set_axis(parts, axis=1),
                    "infer": full[[f"infer_{p}" for p in parts]].set_axis(parts, axis=1)}, axis=1)
pd.concat([full[["flops_bf16_tflops", "hbm_tb_s", "nvlink_gb_s", "train_plan"]], shares],
          axis=1).round(3)

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
styles = {"logic": "o-", "memory": "s--", "network": "^:", "full": "D-"}
for mode, g in df.groupby("scaling", sort=False):
    axes[0].plot(g["node_nm"], g["train_step_s"], styles[mode], label=f"{mode} only"
                 if mode != "full" else "full (logic + memory + network)")
    axes[1].plot(g["node_nm"], g["infer_tpot_ms"], styles[mode], label=mode)
for ax, title, unit, ticks in (
        (axes[0], "GPT-3 175B training step, 1,024 GPUs", "step time (s)", [2, 3, 5, 10, 20, 30]),
        (axes[1], "Llama-2 70B decode, TP 8, batch 1", "time per token (ms)", [13, 15, 20, 25, 30])):
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.invert_xaxis()
    nodes = sorted(df["node_nm"].unique(), reverse=True)
    ax.set_xticks(nodes, [f"{n:g}" for n in nodes])
    ax.minorticks_off()
    ax.set_xlabel("logic node (nm)")
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
axes[0].legend(fontsize=8)
fig.tight_layout()
fig.savefig("figures/04_nodes.png", dpi=110)

# %%
fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), sharey=True)
colors = dict(zip(parts, ["tab:blue", "tab:orange", "tab:green", "tab:gray"]))
panels = [(axes[0, 0], "train", "logic"), (axes[0, 1], "train", "full"),
          (axes[1, 0], "infer", "memory"), (axes[1, 1], "infer", "full")]
for ax, work, mode in panels:
    g = df[df["scaling"] == mode]
    x = np.arange(len(g))
    bottom = np.zeros(len(g))
    for p in parts:
        v = np.clip(g[f"{work}_{p}"].to_numpy(), 0, None)
        ax.bar(x, v, bottom=bottom, color=colors[p], label=p)
        bottom += v
    ax.set_xticks(x, [f"{n:g}" for n in g["node_nm"]])
    what = "training step" if work == "train" else "decode (e2e)"
    ax.set_title(f"{what}: {mode} scaling", fontsize=10)
    ax.set_ylim(0, 1.02)
for ax in axes[1]:
    ax.set_xlabel("logic node (nm)")
for ax in axes[:, 0]:
    ax.set_ylabel("share of time")
axes[0, 0].legend(fontsize=8, loc="lower left")
fig.tight_layout()
fig.savefig("figures/04_bottlenecks.png", dpi=110)

# %%
g = {m: d.set_index("node_nm") for m, d in df.groupby("scaling")}
fl = g["logic"]["flops_bf16_tflops"]
print(f"FLOP/s 12 -> 1 nm (logic only): {fl[1.0] / fl[12.0]:.1f}x")
for m in ("logic", "memory", "network", "full"):
    t, i = g[m]["train_step_s"], g[m]["infer_tpot_ms"]
    print(f"{m:8s} training {t[12.0]:.2f} -> {t[1.0]:.2f} s ({t[12.0] / t[1.0]:.2f}x), "
          f"decode {i[12.0]:.1f} -> {i[1.0]:.1f} ms ({i[12.0] / i[1.0]:.2f}x)")
lo = g["logic"].loc[1.0]
print(f"logic-only at 1 nm, training shares: compute {lo['train_compute']:.0%}, memory "
      f"{lo['train_memory']:.0%}, network {lo['train_network']:.0%}")
fu = g["full"].loc[1.0]
print(f"full at 1 nm: training compute {fu['train_compute']:.0%}, network "
      f"{fu['train_network']:.0%}; decode memory {fu['infer_memory']:.0%}, latency "
      f"{fu['infer_latency']:.0%}")

# %% [markdown]
# Two details of the bars. Memory-only scaling turns batch-1 decode partly compute-bound (35 %
# at 1 nm): with the 12 nm datapath, GEMMs with one row run at a small fraction of peak (the
# size-dependent matmul efficiency), so once HBM4e removes the weight-streaming time the
# FLOP/s show. And the training shares under full scaling move with the best plan, which changes
# along the way (pipeline depth 8 to 4 to 1-2).

# %% [markdown]
# **Finding.** From 12 nm to 1 nm, logic-only scaling multiplies the FLOP/s by 17.6x but
# training only by 5.1x (28.1 s to 5.5 s), because the 12 nm-era HBM2 and NVLink2 take over
# (39 % memory-bound, 47 % network-bound at 1 nm); full scaling gives 13.0x (2.16 s) and stays
# 92 % compute-bound. Batch-1 decode gains only 1.51x from memory-only scaling (28.5 to 18.9 ms)
# and 2.8x from full scaling (10.1 ms; from 5 nm the network is NVLink4, whose all-reduces are
# NCCL ring LL at 0.6 us per hop instead of 2 us), where 88 % of the time is fixed launch and
# all-reduce latency.
