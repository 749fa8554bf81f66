"""The small MoE model the expert-parallel tests share: 4 layers of h = 1024, 8 query heads of
128, 32 gated experts 256 wide, top 4, no dense layers; `STEP` is `train_step` compiled once
for every call (the model's fields are traced, so MoE and dense models run one trace)."""

import equinox as eqx

import diffperf as dp

EFF = dp.Efficiency()
H100 = dp.system("h100-sxm5-80gb")
STEP = eqx.filter_jit(dp.train_step)
L, H, E, K, F, V = 4, 1024, 32, 4, 256, 1000
MOE = dp.Transformer(layers=L, hidden=H, heads=8, kv_heads=8, ffn_hidden=F, vocab=V,
                     seq_len=2048, gated_mlp=1, num_experts=E, experts_per_token=K, dropout=0)
