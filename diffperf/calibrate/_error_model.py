"""The error model of a prediction: how wide its interval is, and why.

A prediction's log error `r = log(predicted / measured)` is modelled as a scale times a
standardised error,

    r = s(x) e,    log s(x) = b . c(x),

where `c(x)` are the covariates of the configuration x (`COVARIATES`): one intercept per
predicted quantity (a training step, a batch-1 latency, ..., a served TTFT), *novelty*
covariates that say how far x lies from the configurations the cost model was calibrated on (a
GPU, GEMM precision, runtime or attention family no calibrated run of its kind had; more
experts, GPUs or pipeline stages, or smaller kernels, than any calibrated run), and *regime*
covariates (a MoE model and how narrow its experts are, a runtime whose host issues every
kernel, the size of the training GEMMs, the node count).

Fitting (`fit_error_model`). `b` is the weighted least-squares fit of log |r| on c(x)
(`fit_scale`: Harvey's multiplicative-heteroscedasticity regression; robust to the few
residuals of a factor 10-10^4 that a Gaussian likelihood would chase), each residual weighted
1 / sqrt(its source's residual count) so that a 720-run table does not drown a 7-run one, a
ridge penalty `RIDGE` on the slopes, and the novelty slopes held >= 0 (further from the
calibration data is never narrower). The residuals are cross-validated: each calibrated
table's predictions come from the fit without that table, and its novelty covariates are
measured against the support of the *other* tables (so a table that alone ran a GPU counts as
an unseen GPU); tables never fitted (held-out runs, the serving measurements) are measured
against the whole calibration.

Interval (normalised conformal prediction: Lei, G'Sell, Rinaldo, Tibshirani & Wasserman,
"Distribution-free predictive inference for regression", JASA 113 (2018), section 5.2, with
Mondrian groups: Vovk et al., "Algorithmic learning in a random world", 2005). The scores
`|r_i| / s(x_i)` of the fitted residuals give, for a level a and a family of quantities
(training, inference tables, served traffic: their standardised errors have different tails),
the quantile `q_a` (weighted as the fit, with the finite-sample correction a (1 + 1/n_eff));
the interval is

    prediction * exp(-+ q_a s(x)),

so it holds about a of exchangeable new outcomes whatever the shape of e, and is as wide as
the covariates of x say. Why a regression and not conformal groups alone: the covariates are
continuous (4x or 32x beyond the calibrated GPU count), several at once, and most
combinations have no residual of their own; a log-linear scale shares strength across them
and extrapolates monotonically in the novelty covariates. `coverage_by_source` measures it
honestly: the whole procedure (b and q) refitted without each source, then scored on it.

Each interval names what widens it (`ErrorModel.reasons`): "128 experts; calibrated runs had
at most 8 (x1.6 width)".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from ..presets import DEFAULT_RUNTIME, chip_of
from ..specs._hardware import PRECISION_CODES

#: Predicted quantities, one intercept each, with the kind of calibration data whose support
#: their novelty is measured against ("train" or "infer"; serving uses the inference rows).
QUANTITY_KINDS = {
    "step_time": "train",
    "latency": "infer", "throughput": "infer", "ttft": "infer",
    "serve_ttft": "infer", "serve_token_latency": "infer", "serve_throughput": "infer",
}

#: Families of quantities with their own conformal quantiles (Mondrian conformal prediction:
#: the standardised errors of a training step, an inference table and a simulated serving
#: run have different tails), and "all" (pooled: for a family with no residuals).
FAMILIES = ("train", "infer", "serve", "all")


def family_of(quantity: str) -> str:
    return "serve" if quantity.startswith("serve") else QUANTITY_KINDS[quantity]


def families(C: np.ndarray) -> np.ndarray:
    """The family of each covariate row: its quantity's (from the intercept column)."""
    C = np.asarray(C)
    q = np.argmax(C[..., :len(QUANTITY_KINDS)], axis=-1)
    names = np.array([family_of(n) for n in QUANTITY_KINDS])
    return names[q]


#: Novelty covariates (slopes held >= 0), each with the words of its reason.
NOVELTY = ("gpu_unseen", "precision_unseen", "serve_gpu_unseen", "serve_precision_unseen",
           "runtime_unseen", "attention_unseen",
           "experts_beyond", "gpus_beyond", "gpus_below", "pp_beyond", "kernel_below")
#: The serving simulator's own copies of novelty covariates (`covariates`) -> the covariate
#: whose reason text they share.
SERVE_COPIES = {"serve_gpu_unseen": "gpu_unseen", "serve_precision_unseen": "precision_unseen"}
#: Regime covariates (slopes of either sign).
REGIME = ("moe", "narrow_experts", "host_issuing", "small_kernel", "nodes", "serve_offline",
          "serve_closed_loop", "attention_dp", "python_engine")
#: Serving engine families whose scheduler runs in Python.
PYTHON_ENGINES = ("vllm", "sglang")
#: Every covariate, in the order of `ErrorModel.coef`.
COVARIATES = tuple(f"q:{q}" for q in QUANTITY_KINDS) + NOVELTY + REGIME

#: Ridge penalty on the slopes (in units of the weighted mean squared log |r| residual): it
#: keeps a slope that the residuals cannot identify near zero.
RIDGE = 0.01
#: GEMM size (FLOPs of one MLP GEMM of one micro-batch) below which a training step's kernels
#: count as small: 100 GFLOP, about 0.3 ms on an A100 at 312 TFLOP/s; the calibrated
#: Megatron-Core runs are at or above it, the eager single-node runs 10-100x below.
SMALL_KERNEL_FLOPS = 1e11
#: Smallest |r| whose log the scale regression takes (0.2 %: a residual below it is as good
#: as exact; log 0 would be -inf).
ABS_FLOOR = 2e-3
#: Fewest residuals of a family that get their own conformal quantiles (else the pooled).
MIN_FAMILY_RESIDUALS = 20
#: Levels at which the conformal quantiles are stored (interpolated between).
LEVELS = tuple(round(0.01 * i, 2) for i in range(1, 100))
PRECISION_NAMES = {0: "fp32", 1: "16-bit", 2: "fp8", 3: "fp4"}


@dataclass(frozen=True)
class Descriptor:
    """What the error model reads of one prediction: its quantity and the facts of its
    configuration that covariates are made of."""

    quantity: str
    gpu: str
    precision: int  # GEMM precision class: 0 fp32/tf32, 1 16-bit, 2 fp8, 3 fp4
    runtime: str  # training runtime preset, or serving engine family
    num_experts: float = 1.0
    expert_ratio: float = 1.0  # hidden / expert FFN width (MoE), 1 for dense models
    attention: tuple[str, ...] = ()  # special attention kinds: "mla", "sliding_window"
    num_gpus: float = 1.0
    nodes: float = 1.0
    pp: float = 1.0
    kernel_flops: float = 0.0  # FLOPs of one MLP GEMM of one micro-batch (training), else 0
    host_issuing: bool = False
    #: Serving traffic: "offline" (every request at once), "closed" (fixed concurrency),
    #: "online" (arrivals at a rate or from a trace); "" for other quantities.
    load: str = ""
    #: The measured deployment ran attention data-parallel (DeepSeek-style serving,
    #: `InferencePlan.attention_dp`): no calibrated run did (only published serving rows).
    attention_dp: bool = False

    @property
    def kind(self) -> str:
        return QUANTITY_KINDS[self.quantity]


def _num(values: dict, key: str, default: float) -> float:
    v = values.get(key)
    if v is None or (isinstance(v, str) and not v.strip()):
        return default
    try:
        x = float(v)
    except (TypeError, ValueError):
        return default
    return x if math.isfinite(x) else default


def precision_class(precision) -> int:
    """Precision class (0 fp32, 1 16-bit, 2 fp8, 3 fp4) of a name or code; 16-bit when unknown
    (int8 / int4 weights compute at the activation precision)."""
    if isinstance(precision, str):
        return PRECISION_CODES.get(precision.strip().lower(), 1)
    try:
        p = int(precision)
    except (TypeError, ValueError):
        return 1
    return p if p in PRECISION_NAMES else 1


def engine_family(name: str | None) -> str:
    """A serving engine preset's family: `vllm-a100` -> `vllm`, `trtllm-0.14-triton` ->
    `trtllm`."""
    return (name or "trtllm").split("-")[0].lower()


def descriptor(values: dict, quantity: str, runtime: str | None = None,
               host_issuing: bool = False, load: str = "") -> Descriptor:
    """A `Descriptor` from a benchmark or serving row's columns (or a dict of the same keys
    built from specs): `gpu` (or `gpu_preset`), `precision`, the model columns, `num_gpus`,
    `gpus_per_node`, `tp`, `pp`, `micro_batch`, `seq_len`, `cp`. `runtime`: the training
    runtime preset (default: the row's `runtime`, else Megatron-Core) or the serving engine
    (inference quantities: its family; when not given, the default runtime's, `megatron`: the
    calibration set's TensorRT-LLM 0.x, as its rows are described). `load`: a served
    quantity's traffic ("offline", "closed", "online"); a row's `attention_dp` column is
    read."""
    if load not in ("", "offline", "closed", "online"):
        raise ValueError(f"load must be offline, closed or online, got {load!r}")
    if quantity not in QUANTITY_KINDS:
        raise ValueError(f"unknown quantity {quantity!r} (one of {', '.join(QUANTITY_KINDS)})")
    kind = QUANTITY_KINDS[quantity]
    gpu = str(values.get("gpu_preset") or values.get("gpu") or "")
    try:
        gpu = chip_of(gpu)
    except (KeyError, ValueError):
        gpu = gpu.lower()
    if kind == "train":
        rt = str(runtime or values.get("runtime") or DEFAULT_RUNTIME)
    else:
        # without an engine or runtime: the default runtime, whose inference side is the
        # calibration set's TensorRT-LLM 0.x (family "megatron", as the calibrated rows have)
        rt = engine_family(runtime or values.get("engine_preset") or values.get("runtime")
                           or DEFAULT_RUNTIME)
    hidden = _num(values, "hidden", 1.0)
    ffn = _num(values, "ffn_hidden", hidden)
    experts = max(_num(values, "num_experts", 1.0), 1.0)
    top_k = max(_num(values, "experts_per_token", 1.0), 1.0)
    tp = max(_num(values, "tp", 1.0), 1.0)
    pp = max(_num(values, "pp", 1.0), 1.0)
    gpus = max(_num(values, "num_gpus", tp * pp), 1.0)
    per_node = max(_num(values, "gpus_per_node", 8.0), 1.0)
    attention = tuple(f for f, col in (("mla", "kv_lora_rank"),
                                       ("sliding_window", "sliding_window"))
                      if _num(values, col, 0.0) > 0)
    kernel = 0.0
    if kind == "train":
        tokens = (_num(values, "micro_batch", 1.0) * _num(values, "seq_len", 2048.0)
                  / max(_num(values, "cp", 1.0), 1.0))
        if experts > 1:
            tokens *= top_k / experts  # one expert's share of the routed tokens
        kernel = 2.0 * tokens * hidden * ffn / tp
    return Descriptor(quantity=quantity, gpu=gpu,
                      precision=precision_class(values.get("precision", "bf16")),
                      runtime=rt, num_experts=experts,
                      expert_ratio=hidden / ffn if experts > 1 else 1.0,
                      attention=attention, num_gpus=gpus, nodes=math.ceil(gpus / per_node),
                      pp=pp, kernel_flops=kernel, host_issuing=bool(host_issuing),
                      load=load if quantity.startswith("serve") else "",
                      attention_dp=_num(values, "attention_dp", 0.0) > 0)


def support_of(descriptors) -> dict:
    """What a set of calibrated configurations spans, per kind ("train", "infer"): GPUs,
    precision classes, runtimes, attention kinds, the largest expert count, GPU count and
    pipeline depth, the smallest GPU count and training GEMM."""
    out: dict = {}
    for d in descriptors:
        s = out.setdefault(d.kind, {"gpus": set(), "precisions": set(), "runtimes": set(),
                                    "attention": set(), "max_experts": 1.0, "max_gpus": 1.0,
                                    "min_gpus": math.inf, "max_pp": 1.0,
                                    "min_kernel": math.inf})
        s["gpus"].add(d.gpu)
        s["precisions"].add(d.precision)
        s["runtimes"].add(d.runtime)
        s["attention"].update(d.attention)
        s["max_experts"] = max(s["max_experts"], d.num_experts)
        s["max_gpus"] = max(s["max_gpus"], d.num_gpus)
        s["min_gpus"] = min(s["min_gpus"], d.num_gpus)
        s["max_pp"] = max(s["max_pp"], d.pp)
        if d.kernel_flops > 0:
            s["min_kernel"] = min(s["min_kernel"], d.kernel_flops)
    return {k: {key: (sorted(v) if isinstance(v, set) else
                      (None if v == math.inf else float(v)))
                for key, v in s.items()} for k, s in out.items()}


def _beyond(x: float, limit: float | None) -> float:
    """log2(x / limit) where x exceeds `limit`, else 0 (also without a limit)."""
    return math.log2(x / limit) if limit and x > limit else 0.0


def covariates(d: Descriptor, support: dict) -> np.ndarray:
    """The covariate vector (`COVARIATES` order) of `d` against `support` (`support_of`).
    A kind with no calibrated configuration at all counts as unseen on every axis."""
    s = support.get(d.kind)
    c = dict.fromkeys(COVARIATES, 0.0)
    c[f"q:{d.quantity}"] = 1.0
    if s is None:
        s = {"gpus": [], "precisions": [], "runtimes": [], "attention": [], "max_experts": 1.0,
             "max_gpus": 1.0, "min_gpus": 1.0, "max_pp": 1.0, "min_kernel": None}
    # an unseen GPU or precision has its own slope for the serving simulator: with one shared
    # slope the simulator's errors there (scheduler and engine effects on top of the cost
    # model) set the static predictions' widths, and when they shrank a static FP4 interval
    # no longer widened for its precision (calibration/EXPERIMENTS.md, 2026-11-28)
    serve = "serve_" if d.quantity.startswith("serve") else ""
    c[f"{serve}gpu_unseen"] = float(d.gpu not in s["gpus"])
    c[f"{serve}precision_unseen"] = float(d.precision not in s["precisions"])
    c["runtime_unseen"] = float(d.runtime not in s["runtimes"])
    c["attention_unseen"] = float(sum(f not in s["attention"] for f in d.attention))
    c["experts_beyond"] = _beyond(d.num_experts, s["max_experts"])
    c["gpus_beyond"] = _beyond(d.num_gpus, s["max_gpus"])
    c["gpus_below"] = _beyond(s["min_gpus"] or 1.0, d.num_gpus)
    c["pp_beyond"] = _beyond(d.pp, s["max_pp"])
    if d.kernel_flops > 0:
        c["kernel_below"] = _beyond(s["min_kernel"] or 0.0, d.kernel_flops)
        c["small_kernel"] = _beyond(SMALL_KERNEL_FLOPS, d.kernel_flops)
    if d.num_experts > 1:
        c["moe"] = math.log2(d.num_experts) / 8.0  # 1 at 256 experts
        c["narrow_experts"] = max(math.log2(d.expert_ratio), 0.0)
    c["host_issuing"] = float(d.host_issuing)
    c["nodes"] = math.log2(max(d.nodes, 1.0))
    c["serve_offline"] = float(d.load == "offline")
    c["serve_closed_loop"] = float(d.load == "closed")
    c["attention_dp"] = float(d.attention_dp)
    c["python_engine"] = float(d.quantity.startswith("serve") and d.runtime in PYTHON_ENGINES)
    return np.array([c[k] for k in COVARIATES], dtype=np.float64)


def _reason_text(name: str, d: Descriptor, support: dict) -> str:
    s = support.get(d.kind) or {}
    what = "training" if d.kind == "train" else "inference"
    return {
        "gpu_unseen": f"no calibrated {what} run on {d.gpu}",
        "precision_unseen": f"no calibrated {what} run at {PRECISION_NAMES[d.precision]} "
                            f"GEMM precision",
        "runtime_unseen": f"runtime {d.runtime} never calibrated for {what}",
        "attention_unseen": f"{' and '.join(d.attention)} attention never calibrated",
        "experts_beyond": f"{d.num_experts:.0f} experts, calibrated runs had at most "
                          f"{s.get('max_experts', 1):.0f}",
        "gpus_beyond": f"{d.num_gpus / (s.get('max_gpus') or 1):.1f}x more GPUs than any "
                       f"calibrated {what} run",
        "gpus_below": f"fewer GPUs ({d.num_gpus:.0f}) than any calibrated {what} run",
        "pp_beyond": f"{d.pp:.0f} pipeline stages, calibrated runs had at most "
                     f"{s.get('max_pp', 1):.0f}",
        "kernel_below": "GEMMs smaller than any calibrated run's",
        "moe": f"a MoE model ({d.num_experts:.0f} experts)",
        "narrow_experts": f"narrow experts (FFN width hidden / {d.expert_ratio:.1f})",
        "host_issuing": f"runtime {d.runtime} issues every kernel from the host",
        "small_kernel": f"small GEMMs ({d.kernel_flops / 1e9:.2g} GFLOP each)",
        "nodes": f"{d.nodes:.0f} nodes",
        "serve_offline": "all requests at once (offline throughput)",
        "serve_closed_loop": "a fixed number of clients (closed loop)",
        "attention_dp": "attention data parallelism (no calibrated run used it)",
        "python_engine": f"{d.runtime} serving engine (Python scheduler)",
    }[name]


@dataclass
class ErrorModel:
    """A fitted error model: log-scale coefficients per covariate, the conformal quantiles of
    the standardised residuals, and the calibration support novelty is measured against."""

    coef: np.ndarray
    quantiles: dict  # family (FAMILIES) -> q at each of LEVELS
    support: dict
    n: int = 0
    basis: str = ""
    names: tuple[str, ...] = field(default=COVARIATES)

    def log_scale(self, c) -> np.ndarray:
        """log s(x) = b . c(x) for covariates `c` (`[..., P]`)."""
        return np.asarray(c, dtype=np.float64) @ self.coef

    def quantile(self, level: float, family: str = "all") -> float:
        """The conformal quantile q_a of |r| / s at two-sided coverage `level` (in (0, 1)) of
        a family of quantities (`FAMILIES`; the pooled one where the family had none)."""
        if not 0.0 < level < 1.0:
            raise ValueError(f"level must lie in (0, 1), got {level}")
        q = self.quantiles.get(family, self.quantiles["all"])
        return float(np.interp(level, LEVELS, q))

    def log_half_width(self, c, level: float = 0.9) -> np.ndarray:
        """Half-width of the interval in log units: q_a s(x), q_a of x's family."""
        c = np.asarray(c, dtype=np.float64)
        fam = families(c)
        q = np.array([self.quantile(level, f) for f in np.atleast_1d(fam)]).reshape(fam.shape)
        return q * np.exp(self.log_scale(c))

    def for_descriptor(self, d: Descriptor, level: float = 0.9) -> float:
        return float(self.log_half_width(covariates(d, self.support), level))

    def reasons(self, d: Descriptor, top: int = 5, c=None) -> list[str]:
        """What widens `d`'s interval beyond a calibrated configuration of its quantity: the
        covariates with the largest positive contributions (at most `top`, each widening it by
        at least 5 %), each with the factor it multiplies the width by ("128 experts, calibrated
        runs had at most 8 (x1.6 width)"). `c`: its covariates when already computed."""
        c = covariates(d, self.support) if c is None else np.asarray(c)
        out = []
        for i in np.argsort(-(c * self.coef)):
            name = self.names[i]
            factor = math.exp(c[i] * self.coef[i])
            if name.startswith("q:") or factor < 1.05 or len(out) >= top:
                continue
            out.append(f"{_reason_text(SERVE_COPIES.get(name, name), d, self.support)} "
                       f"(x{factor:.2f} width)")
        return out

    def to_json(self) -> dict:
        return {"covariates": list(self.names), "coef": [float(x) for x in self.coef],
                "levels": list(LEVELS),
                "quantiles": {k: [float(x) for x in v] for k, v in self.quantiles.items()},
                "support": self.support, "n": int(self.n), "basis": self.basis}

    @classmethod
    def from_json(cls, data, where: str = "error_model") -> ErrorModel:
        """An `ErrorModel` from `to_json`'s dict, or a ValueError naming the bad key."""
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object")
        names = tuple(data.get("covariates", ()))
        if names != COVARIATES:
            raise ValueError(f"{where}.covariates does not match this version's covariates "
                             f"(refit it with python calibration/fit_error_model.py)")

        def arr_of(value, key, size):
            try:
                a = np.asarray(value, dtype=np.float64)
            except (TypeError, ValueError):
                raise ValueError(f"{where}.{key} must be a list of numbers") from None
            if a.shape != (size,) or not np.all(np.isfinite(a)):
                raise ValueError(f"{where}.{key} must hold {size} finite numbers")
            return a

        arr = lambda key, size: arr_of(data.get(key), key, size)  # noqa: E731

        levels = arr("levels", len(LEVELS))
        if not np.allclose(levels, LEVELS):
            raise ValueError(f"{where}.levels must be {LEVELS[0]}..{LEVELS[-1]} by 0.01")
        qs = data.get("quantiles")
        if not isinstance(qs, dict) or "all" not in qs or not set(qs) <= set(FAMILIES):
            raise ValueError(f"{where}.quantiles must map families ({', '.join(FAMILIES)}, "
                             f"'all' required) to quantiles")
        q = {}
        for k in qs:
            q[k] = arr_of(qs[k], f"quantiles.{k}", len(LEVELS))
            if np.any(q[k] < 0) or np.any(np.diff(q[k]) < 0):
                raise ValueError(f"{where}.quantiles.{k} must be >= 0 and non-decreasing")
        support = _checked_support(data.get("support"), f"{where}.support")
        return cls(arr("coef", len(COVARIATES)), q, support, int(data.get("n", 0)),
                   str(data.get("basis", "")))


def _checked_support(support, where: str) -> dict:
    """A saved `support_of` dict, or a ValueError naming the bad key: per kind ("train",
    "infer") lists of GPU ids, precision classes 0-3, runtimes and attention kinds, and the counts
    (>= 1; the smallest GPU count and GEMM may be null)."""
    if not isinstance(support, dict) or not set(support) <= {"train", "infer"}:
        raise ValueError(f"{where} must map 'train' / 'infer' to what they span, got "
                         f"{support!r}")
    number = lambda x: (isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
                        and math.isfinite(x))
    for kind, s in support.items():
        if not isinstance(s, dict):
            raise ValueError(f"{where}.{kind} must be an object")
        for key in ("gpus", "runtimes", "attention"):
            if not (isinstance(s.get(key), list) and all(isinstance(x, str) for x in s[key])):
                raise ValueError(f"{where}.{kind}.{key} must be a list of names, got "
                                 f"{s.get(key)!r}")
        p = s.get("precisions")
        if not (isinstance(p, list) and all(number(x) and x == round(x) and 0 <= x <= 3
                                            for x in p)):
            raise ValueError(f"{where}.{kind}.precisions must be precision classes 0-3, got "
                             f"{p!r}")
        for key in ("max_experts", "max_gpus", "max_pp", "min_gpus", "min_kernel"):
            x = s.get(key)
            if not ((x is None and key.startswith("min")) or (number(x) and x >= 1)):
                raise ValueError(f"{where}.{kind}.{key} must be a number >= 1, got {x!r}")
    return {k: {**s, "precisions": [int(x) for x in s["precisions"]]}
            for k, s in support.items()}


def _weights(groups) -> np.ndarray:
    """1 / sqrt(residuals of the same group), normalised to mean 1."""
    groups = np.asarray(groups)
    _, inv, counts = np.unique(groups, return_inverse=True, return_counts=True)
    w = 1.0 / np.sqrt(counts[inv])
    return w / w.mean()


def _weighted_quantile(x: np.ndarray, w: np.ndarray, level: float) -> float:
    """The smallest x whose weighted share of x <= it reaches `level` (inf past 1)."""
    if level >= 1.0:
        return float(np.max(x))
    order = np.argsort(x)
    cum = np.cumsum(w[order]) / w.sum()
    return float(x[order][min(int(np.searchsorted(cum, level)), x.size - 1)])


def fit_scale(C: np.ndarray, r: np.ndarray, w: np.ndarray, ridge: float = RIDGE) -> np.ndarray:
    """b of log s = C b: weighted least squares of log |r| on C (Harvey's multiplicative
    heteroscedasticity regression, Econometrica 44 (1976) 461: E log |r| = log s + E log |e|,
    the constant absorbed by the intercepts and the conformal quantiles), |r| floored at
    `ABS_FLOOR`, a ridge on the slopes, novelty slopes held >= 0 (active set: a slope that
    would go negative is held at 0, and freed again where the gradient asks). A log-scale fit
    is robust to the few residuals of 2-9 (a factor of 7 to 10^4) that would dominate a
    Gaussian likelihood; the tails are left to the conformal quantiles. An intercept that no
    residual informs takes the largest fitted one (a conservative guess)."""
    C, r, w = np.asarray(C, float), np.asarray(r, float), np.asarray(w, float)
    nq = len(QUANTITY_KINDS)
    y = np.log(np.maximum(np.abs(r), ABS_FLOOR))
    slope = np.array([not n.startswith("q:") for n in COVARIATES], dtype=float)
    A = (C.T * w) @ C / w.sum() + ridge * np.diag(slope)
    c = (C.T * w) @ y / w.sum()
    present = C[:, :nq].any(axis=0)
    novelty = np.array([n in NOVELTY for n in COVARIATES])
    free = np.ones(len(COVARIATES), dtype=bool)
    free[:nq] = present
    b = np.zeros(len(COVARIATES))
    for _ in range(4 * len(COVARIATES)):
        b = np.zeros(len(COVARIATES))
        idx = np.flatnonzero(free)
        b[idx] = np.linalg.solve(A[np.ix_(idx, idx)], c[idx])
        negative = np.flatnonzero(novelty & free & (b < 0))
        if negative.size:
            free[negative[np.argmin(b[negative])]] = False
            continue
        gradient = 2.0 * (A @ b - c)
        wanting = np.flatnonzero(novelty & ~free & (gradient < -1e-12))
        if not wanting.size:
            break
        free[wanting[np.argmin(gradient[wanting])]] = True
    if (~present).any() and present.any():
        b[:nq][~present] = b[:nq][present].max()
    return b


def conformal_quantiles(scores: np.ndarray, w: np.ndarray) -> np.ndarray:
    """q at each of `LEVELS`: weighted quantiles of the scores at a (1 + 1/n_eff)."""
    n_eff = w.sum() ** 2 / np.sum(w * w)
    return np.array([_weighted_quantile(scores, w, min(a * (1.0 + 1.0 / n_eff), 1.0))
                     for a in LEVELS])


def family_quantiles(C: np.ndarray, scores: np.ndarray, w: np.ndarray) -> dict:
    """`conformal_quantiles` per family of quantities (`families`) and pooled ("all")."""
    fam = families(C)
    out = {"all": conformal_quantiles(scores, w)}
    for f in FAMILIES[:-1]:
        sel = fam == f
        if sel.sum() >= MIN_FAMILY_RESIDUALS:
            out[f] = conformal_quantiles(scores[sel], w[sel])
    return out


def fit_error_model(C: np.ndarray, r: np.ndarray, groups, support: dict,
                    ridge: float = RIDGE, basis: str = "") -> ErrorModel:
    """The error model of residuals `r` (log predicted / measured) with covariates `C`
    (`covariates` rows), source `groups` (weights 1 / sqrt(count)) and the calibration
    `support` new predictions are compared against."""
    C, r = np.asarray(C, float), np.asarray(r, float)
    if C.shape != (r.size, len(COVARIATES)):
        raise ValueError(f"covariates must be [{r.size}, {len(COVARIATES)}], got {C.shape}")
    if r.size < 2 or not np.all(np.isfinite(r)):
        raise ValueError("the error model needs at least two finite residuals")
    w = _weights(groups)
    b = fit_scale(C, r, w, ridge)
    scores = np.abs(r) / np.exp(C @ b)
    return ErrorModel(b, family_quantiles(C, scores, w), support, int(r.size), basis)


def coverage_by_source(C: np.ndarray, r: np.ndarray, groups, levels=(0.9,),
                       ridge: float = RIDGE) -> dict:
    """Leave-one-source-out coverage of the whole procedure: for each source, the error model
    (scale and quantiles) fitted on the other sources' residuals, and each of its residuals
    scored at `levels`. **Returns** `{"inside": [n, L] bool, "half_width": [n, L] (log),
    "scale": [n]}` in the order of `r`."""
    C, r, groups = np.asarray(C, float), np.asarray(r, float), np.asarray(groups)
    inside = np.zeros((r.size, len(levels)), dtype=bool)
    half = np.zeros((r.size, len(levels)))
    scale = np.zeros(r.size)
    for g in np.unique(groups):
        held = groups == g
        model = fit_error_model(C[~held], r[~held], groups[~held], {}, ridge)
        scale[held] = np.exp(C[held] @ model.coef)
        for j, a in enumerate(levels):
            half[held, j] = model.log_half_width(C[held], a)
            inside[held, j] = np.abs(r[held]) <= half[held, j]
    return {"inside": inside, "half_width": half, "scale": scale}


def spec_descriptor(model, system, plan, quantity: str, gpu: str, runtime: str | None = None,
                    host_issuing: bool = False, load: str = "") -> Descriptor:
    """`descriptor` of a prediction made from specs: a `Transformer`, a `System` (its NVLink
    domain stands for a node), a `TrainingPlan` or `InferencePlan`, the GPU id whose
    calibration applies, and the runtime preset (training) or serving engine."""
    f = lambda x: float(np.max(np.asarray(x)))  # noqa: E731
    values = {k: f(getattr(model, k)) for k in (
        "hidden", "ffn_hidden", "num_experts", "experts_per_token", "kv_lora_rank",
        "sliding_window", "seq_len")}
    values.update(gpu=gpu, tp=f(plan.tp), pp=f(plan.pp), num_gpus=f(plan.num_gpus),
                  gpus_per_node=f(system.network.nvlink_domain))
    if hasattr(plan, "micro_batch"):  # a training plan
        values.update(micro_batch=f(plan.micro_batch), cp=f(plan.cp),
                      precision=int(f(plan.precision)))
    else:
        values["precision"] = int(f(plan.math_precision))
    return descriptor(values, quantity, runtime, host_issuing, load)


def _beyond_jax(x, limit):
    """`_beyond` on arrays: log2(x / limit) where x exceeds `limit` (> 0), else 0."""
    return jnp.maximum(jnp.log2(x / limit), 0.0)


def sweep_covariates(base: Descriptor, support: dict, num_gpus, pp, kernel_flops=None,
                     nodes=None):
    """Covariates of a sweep's configurations as a JAX array `[..., P]`: `base`'s quantity,
    GPU, precision, runtime and model, with the GPU count, pipeline depth, training GEMM size
    and node count varying (arrays of one shape; `kernel_flops` / `nodes` default to
    `base`'s). Pure `jax.numpy`, so it runs under `jit` / `vmap` beside the cost model:
    equal to `covariates` of each configuration's `Descriptor`."""
    num_gpus = jnp.asarray(num_gpus, dtype=jnp.result_type(float))
    pp = jnp.broadcast_to(jnp.asarray(pp, dtype=num_gpus.dtype), num_gpus.shape)
    kernel = jnp.broadcast_to(jnp.asarray(base.kernel_flops if kernel_flops is None
                                          else kernel_flops, dtype=num_gpus.dtype),
                              num_gpus.shape)
    nodes = jnp.broadcast_to(jnp.asarray(base.nodes if nodes is None else nodes,
                                         dtype=num_gpus.dtype), num_gpus.shape)
    fixed = covariates(base, support)
    s = support.get(base.kind) or {}
    varying = {
        "gpus_beyond": _beyond_jax(num_gpus, s.get("max_gpus") or 1.0),
        "gpus_below": _beyond_jax(s.get("min_gpus") or 1.0, num_gpus)
        if s.get("min_gpus") else jnp.zeros_like(num_gpus),
        "pp_beyond": _beyond_jax(pp, s.get("max_pp") or 1.0),
        "nodes": jnp.log2(jnp.maximum(nodes, 1.0)),
    }
    if base.kernel_flops > 0:
        varying["kernel_below"] = (_beyond_jax(s["min_kernel"], kernel) if s.get("min_kernel")
                                   else jnp.zeros_like(kernel))
        varying["small_kernel"] = _beyond_jax(SMALL_KERNEL_FLOPS, kernel)
    columns = [varying.get(n, jnp.full(num_gpus.shape, fixed[i], dtype=num_gpus.dtype))
               for i, n in enumerate(COVARIATES)]
    return jnp.stack(columns, axis=-1)


def sweep_half_width(model: ErrorModel, c, quantity: str, level: float = 0.9):
    """`ErrorModel.log_half_width` in `jax.numpy` for covariates `c` `[..., P]` of
    configurations of `quantity` (`sweep_covariates`): q_a exp(c . b). A sweep's interval is
    value * exp(-+ it)."""
    return (model.quantile(level, family_of(quantity))
            * jnp.exp(jnp.asarray(c) @ jnp.asarray(model.coef, dtype=jnp.result_type(float))))
