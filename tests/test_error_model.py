"""The error model of prediction intervals (`diffperf.calibrate._error_model`): it recovers a
known heteroscedastic noise and its nominal coverage, widens with novelty, and explains why."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from diffperf.calibrate._error_model import (
    COVARIATES,
    LEVELS,
    NOVELTY,
    ErrorModel,
    covariates,
    coverage_by_source,
    descriptor,
    fit_error_model,
    support_of,
)

TRAIN_ROW = {"gpu": "h100-sxm5-80gb", "precision": "bf16", "hidden": 8192, "ffn_hidden": 28672,
             "num_experts": 1, "experts_per_token": 1, "num_gpus": 64, "gpus_per_node": 8,
             "tp": 4, "pp": 4, "micro_batch": 1, "seq_len": 4096, "cp": 1}


def _synthetic(n_sources=12, per_source=150, seed=0, heavy_tails=False):
    """Residuals with a known scale: log s = -2.5 + 0.8 gpu_unseen + 0.5 experts_beyond +
    0.3 nodes (training steps), standard errors Gaussian or Student-t (5 d.o.f.)."""
    rng = np.random.default_rng(seed)
    idx = {n: i for i, n in enumerate(COVARIATES)}
    truth = np.zeros(len(COVARIATES))
    truth[idx["q:step_time"]] = -2.5
    truth[idx["gpu_unseen"]] = 0.8
    truth[idx["experts_beyond"]] = 0.5
    truth[idx["nodes"]] = 0.3
    n = n_sources * per_source
    C = np.zeros((n, len(COVARIATES)))
    C[:, idx["q:step_time"]] = 1.0
    C[:, idx["gpu_unseen"]] = rng.random(n) < 0.3
    C[:, idx["experts_beyond"]] = np.where(rng.random(n) < 0.3, rng.uniform(0, 4, n), 0.0)
    C[:, idx["nodes"]] = rng.integers(0, 8, n)
    e = (rng.standard_t(5, n) / math.sqrt(5 / 3)) if heavy_tails else rng.standard_normal(n)
    r = np.exp(C @ truth) * e
    groups = np.repeat(np.arange(n_sources), per_source)
    return C, r, groups, truth


@pytest.mark.parametrize("heavy_tails", [False, True])
def test_recovers_known_heteroscedastic_noise_and_nominal_coverage(heavy_tails):
    C, r, groups, truth = _synthetic(heavy_tails=heavy_tails)
    model = fit_error_model(C, r, groups, {})
    for name in ("gpu_unseen", "experts_beyond", "nodes"):
        i = COVARIATES.index(name)
        assert model.coef[i] == pytest.approx(truth[i], abs=0.12), name
    # Fresh draws from the same distribution: the 90 % and 50 % intervals hold about that.
    C2, r2, _, _ = _synthetic(seed=1, heavy_tails=heavy_tails)
    for level in (0.5, 0.9):
        inside = np.abs(r2) <= model.log_half_width(C2, level)
        assert inside.mean() == pytest.approx(level, abs=0.025)
        # ... also where the noise is 5x wider (the intervals are, too).
        wide = C2[:, COVARIATES.index("gpu_unseen")] > 0
        assert inside[wide].mean() == pytest.approx(level, abs=0.05)
    cov = coverage_by_source(C, r, groups, (0.9,))
    assert cov["inside"].mean() == pytest.approx(0.9, abs=0.025)


def test_homoscedastic_model_equals_the_rms_normal_interval():
    """With only an intercept and Gaussian residuals, the 90 % half-width is about
    1.645 x the RMS residual (the textbook interval)."""
    rng = np.random.default_rng(3)
    r = 0.1 * rng.standard_normal(4000)
    C = np.zeros((r.size, len(COVARIATES)))
    C[:, COVARIATES.index("q:ttft")] = 1.0
    model = fit_error_model(C, r, np.zeros(r.size), {})
    half = float(model.log_half_width(C[:1], 0.9)[0])
    assert half == pytest.approx(1.645 * np.sqrt(np.mean(r * r)), rel=0.05)


def test_novelty_never_narrows_the_interval():
    """Novelty slopes are held >= 0 even when the residuals beyond the support happen to be
    smaller."""
    rng = np.random.default_rng(4)
    n = 2000
    C = np.zeros((n, len(COVARIATES)))
    C[:, COVARIATES.index("q:step_time")] = 1.0
    beyond = rng.random(n) < 0.5
    C[beyond, COVARIATES.index("gpus_beyond")] = 2.0
    r = np.where(beyond, 0.02, 0.1) * rng.standard_normal(n)
    model = fit_error_model(C, r, np.arange(n) % 10, {})
    for name in NOVELTY:
        assert model.coef[COVARIATES.index(name)] >= 0.0


def test_covariates_measure_distance_from_the_support():
    calibrated = [descriptor(TRAIN_ROW, "step_time"),
                  descriptor({**TRAIN_ROW, "num_experts": 8, "experts_per_token": 2,
                              "num_gpus": 512}, "step_time")]
    support = support_of(calibrated)
    new = descriptor({**TRAIN_ROW, "gpu": "b200", "num_experts": 128, "experts_per_token": 8,
                      "num_gpus": 2048, "pp": 16, "kv_lora_rank": 512}, "step_time")
    c = dict(zip(COVARIATES, covariates(new, support)))
    assert c["gpu_unseen"] == 1.0
    assert c["experts_beyond"] == pytest.approx(math.log2(128 / 8))
    assert c["gpus_beyond"] == pytest.approx(math.log2(2048 / 512))
    assert c["pp_beyond"] == pytest.approx(math.log2(16 / 4))
    assert c["attention_unseen"] == 1.0
    assert c["moe"] == pytest.approx(7 / 8)
    assert c["q:step_time"] == 1.0 and c["precision_unseen"] == 0.0
    inside = dict(zip(COVARIATES, covariates(calibrated[0], support)))
    assert all(inside[n] == 0.0 for n in NOVELTY)
    # The training GEMM: 2 x (1 x 4096 tokens) x 8192 x 28672 / TP 4 FLOPs.
    assert calibrated[0].kernel_flops == pytest.approx(2 * 4096 * 8192 * 28672 / 4)
    # Inference novelty is measured against inference rows only.
    infer = descriptor({**TRAIN_ROW, "gpu": "h100-sxm5-80gb"}, "throughput")
    assert dict(zip(COVARIATES, covariates(infer, support)))["gpu_unseen"] == 1.0


def test_reasons_name_what_widens_the_interval_and_json_round_trips():
    support = support_of([descriptor({**TRAIN_ROW, "num_experts": 8, "experts_per_token": 2},
                                     "step_time")])
    coef = np.zeros(len(COVARIATES))
    coef[COVARIATES.index("q:step_time")] = math.log(0.06)
    coef[COVARIATES.index("experts_beyond")] = 0.2
    model = ErrorModel(coef, {"all": np.interp(LEVELS, [0, 1], [0, 3])}, support)
    d = descriptor({**TRAIN_ROW, "num_experts": 128, "experts_per_token": 8}, "step_time")
    reasons = model.reasons(d)
    assert len(reasons) == 1 and "128 experts" in reasons[0] and "at most 8" in reasons[0]
    assert f"x{math.exp(0.2 * 4):.2f}" in reasons[0]
    assert model.reasons(descriptor(TRAIN_ROW, "step_time")) == []
    back = ErrorModel.from_json(model.to_json())
    assert back.for_descriptor(d) == pytest.approx(model.for_descriptor(d))
    bad = {**model.to_json(), "quantiles": {"all": list(np.interp(LEVELS, [0, 1], [3, 0]))}}
    with pytest.raises(ValueError, match="non-decreasing"):
        ErrorModel.from_json(bad)


def test_unknown_quantity_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown quantity 'tokens'"):
        descriptor(TRAIN_ROW, "tokens")


def test_sweep_covariates_under_vmap_equal_the_loop():
    """A sweep's covariates and half-widths in `jax.numpy` (jit / vmap over plans) equal
    `covariates` of each configuration's descriptor, and a wider job is never narrower."""
    import dataclasses

    import jax

    from diffperf.calibrate import load_uncertainty
    from diffperf.calibrate._error_model import sweep_covariates, sweep_half_width
    model = load_uncertainty(None).error_model
    base = descriptor(TRAIN_ROW, "step_time")
    gpus = np.array([8.0, 64.0, 1024.0, 16384.0, 65536.0])
    pps = np.array([1.0, 2.0, 8.0, 16.0, 64.0])
    kernels = np.array([1e9, 1e10, 1e11, 1e12, 1e13])

    def one(g, p, k):
        c = sweep_covariates(base, model.support, g, p, k, nodes=jnp.ceil(g / 8))
        return c, sweep_half_width(model, c, "step_time")

    c, half = jax.jit(jax.vmap(one))(gpus, pps, kernels)
    for i in range(gpus.size):
        d = dataclasses.replace(base, num_gpus=gpus[i], pp=pps[i], kernel_flops=kernels[i],
                                nodes=math.ceil(gpus[i] / 8))
        np.testing.assert_allclose(np.asarray(c[i]), covariates(d, model.support), rtol=1e-6,
                                   atol=1e-9)
        assert float(half[i]) == pytest.approx(model.for_descriptor(d), rel=1e-6)
    g = np.geomspace(1024, 1e6, 12)
    widths = jax.vmap(lambda x: sweep_half_width(
        model, sweep_covariates(base, model.support, x, 4.0), "step_time"))(g)
    assert np.all(np.diff(np.asarray(widths)) >= -1e-12)


def test_python_scheduled_serving_engines_have_their_own_covariate():
    """`python_engine`: 1 for a served quantity of vLLM / SGLang (their scheduler, API server
    and per-step work run in Python, the served errors the simulator leaves largest), 0 for
    TensorRT-LLM, LMDeploy-style engines and for every static (non-served) quantity; the
    shipped error model widens those intervals and says why."""
    from diffperf.calibrate._uncertainty import load_uncertainty
    row = {**TRAIN_ROW, "num_gpus": 1, "tp": 1, "pp": 1}
    support = support_of([descriptor(row, "throughput")])
    flag = lambda q, engine: dict(zip(COVARIATES, covariates(  # noqa: E731
        descriptor(row, q, engine, load="online" if q.startswith("serve") else ""),
        support)))["python_engine"]
    assert flag("serve_ttft", "vllm") == 1.0
    assert flag("serve_throughput", "vllm-a100") == 1.0
    assert flag("serve_token_latency", "sglang") == 1.0
    assert flag("serve_ttft", "trtllm") == 0.0
    assert flag("serve_ttft", "trtllm-0.14-triton") == 0.0
    assert flag("throughput", "vllm") == 0.0
    em = load_uncertainty().error_model
    vllm = descriptor(row, "serve_token_latency", "vllm", load="online")
    trt = descriptor(row, "serve_token_latency", "trtllm", load="online")
    slope = dict(zip(em.names, em.coef))["python_engine"]
    assert slope > 0
    assert em.for_descriptor(vllm) == pytest.approx(em.for_descriptor(trt) * math.exp(slope))
    assert any("vllm serving engine" in r for r in em.reasons(vllm))
    assert not any("serving engine" in r for r in em.reasons(trt))
