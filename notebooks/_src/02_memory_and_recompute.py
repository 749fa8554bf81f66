# %% [markdown]
# # Memory and activation recomputation: GPT-3 175B, 530B and 1T on A100-80GB
#
# Korthikanti et al. (2022) trained these models with tensor parallelism 8 and pipeline
# parallelism (8, 35, 64 stages), micro-batch 1. This notebook shows the per-GPU memory of the
# first pipeline stage under no / selective / full recomputation (with sequence parallelism),
# against its HBM (80 GiB, which is 85.9 GB as the driver reports it), and what each mode costs
# in step time.

# %%
import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

import diffperf as dp

system = dp.system("a100-sxm4-80gb")
runs = {  # Korthikanti et al. 2022 Table 3 configurations
    "GPT-3 175B": ("gpt3-175b", dict(tp=8, pp=8, dp=1, global_batch=64, vp=3)),
    "GPT 530B": ("gpt-530b", dict(tp=8, pp=35, dp=1, global_batch=280, vp=3)),
    "GPT 1T": ("gpt-1t", dict(tp=8, pp=64, dp=1, global_batch=512, vp=1)),
}
step = jax.jit(dp.train_step)
rows = []
for label, (name, cfg) in runs.items():
    model = dp.model(name)
    for mode in ("none", "selective", "full"):
        plan = dp.TrainingPlan(micro_batch=1, sequence_parallel=1, recompute=mode, zero=0,
                               flash_attention=0, **cfg)
        r = step(model, system, plan)
        m = r.memory
        rows.append({"model": label, "recompute": mode,
                     "weights+grads+optimizer GB": float(m.weights + m.gradients + m.optimizer) / 1e9,
                     "activations GB": float(m.activations) / 1e9,
                     "total GB": float(m.total) / 1e9, "fits": bool(r.fits),
                     "step time s": float(r.step_time), "MFU": float(r.mfu)})
df = pd.DataFrame(rows)
df.round(2)

# %% [markdown]
# ## Against Korthikanti's formulas
# Per layer and micro-batch (16-bit), with sequence parallelism: no recompute
# `sbh/t (34 + 5as/h)`, selective `34 sbh / t`, full `2 sbh / t`. The model's per-layer numbers
# equal them exactly (the test suite checks 18 cells within 1 %):

# %%
model = dp.model("gpt3-175b")
s, b, h, a, t = 2048, 1, 12288, 96, 8
formula = {"none": s * b * h / t * (34 + 5 * a * s / h), "selective": 34 * s * b * h / t,
           "full": 2 * s * b * h / t}
for mode, want in formula.items():
    plan = dp.TrainingPlan(tp=8, pp=8, micro_batch=1, global_batch=64, sequence_parallel=1,
                           recompute=mode, flash_attention=0)
    got = float(dp.activation_bytes_per_layer(model, plan))
    print(f"{mode:9s} model {got / 1e6:9.1f} MB   Korthikanti {want / 1e6:9.1f} MB")

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
pivot = df.pivot(index="model", columns="recompute", values="total GB")[["none", "selective", "full"]]
pivot.loc[list(runs)].plot.bar(ax=axes[0], rot=0)
hbm_gb = float(system.accelerator.hbm_capacity) / 1e9
axes[0].axhline(hbm_gb, color="k", ls="--", lw=1, label=f"HBM {hbm_gb:.1f} GB")
axes[0].set_ylabel("memory per GPU (GB)")
axes[0].set_title("first-stage memory per GPU")
axes[0].legend(loc="upper left", fontsize=8)
axes[0].set_ylim(0, 140)
tp = df.pivot(index="model", columns="recompute", values="step time s")[["none", "selective", "full"]]
(tp.div(tp["none"], axis=0).loc[list(runs)]).plot.bar(ax=axes[1], rot=0)
axes[1].set_ylabel("step time / no-recompute step time")
axes[1].set_ylim(0.9, 1.4)
axes[1].set_title("time cost of recomputation")
fig.tight_layout()
fig.savefig("figures/02_memory_and_recompute.png", dpi=110)

# %% [markdown]
# **Finding.** Without recomputation none of the three models fits in the A100's 85.9 GB (they
# need 97-123 GB per GPU); selective recomputation fits all three for a few percent of extra
# time (it only recomputes the attention scores), while full recomputation adds about a third to
# the step time.
