"""Shared fixtures: presets and ONE jit-compiled `train_step` for the whole session.

Every spec leaf is a float array of shape (), so a single compiled `train_step` serves every
scalar (model, system, plan, efficiency) combination: tests never recompile per example.
The efficiency passed everywhere is the *uncalibrated* physical default `Efficiency()` so that
the tests do not depend on whichever calibration file happens to ship.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import equinox as eqx
import jax
import pytest

import diffperf as dp

# Guard rails (as in Equinox / Diffrax): no implicit dtype promotion (a float64 leaking into a
# float32 computation, an int array silently widened) and no implicit rank promotion
# (broadcasting a (3,) against a (3, 1) by accident) anywhere the tests reach.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

# One persistent compilation cache per test run, shared by its xdist workers: a program that
# two workers (or two tests building their own `jax.jit` of the same computation) compile is
# compiled once and loaded from disk after that. The run's first process (xdist's controller,
# or the only process with `-n 0`) makes a fresh directory and removes it at the end, so no run
# reuses another's programs and nothing is written outside the temporary directory. It must be
# set before anything compiles (JAX decides once per process whether it uses the cache).
# DIFFPERF_TESTS_JAX_CACHE=0 turns it off (e.g. to time cold compilations).
_JAX_CACHE_ENV = "DIFFPERF_TESTS_JAX_CACHE"
_OWN_JAX_CACHE = None
if os.environ.get(_JAX_CACHE_ENV) != "0":
    if not os.environ.get(_JAX_CACHE_ENV):
        _OWN_JAX_CACHE = tempfile.mkdtemp(prefix="diffperf-tests-jax-cache-")
        os.environ[_JAX_CACHE_ENV] = _OWN_JAX_CACHE  # inherited by the xdist workers
    jax.config.update("jax_compilation_cache_dir", os.environ[_JAX_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def pytest_unconfigure(config):
    if _OWN_JAX_CACHE is not None:
        shutil.rmtree(_OWN_JAX_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _restore_compilation_cache():
    """`diffperf bench` run in-process switches the persistent cache off (it times cold
    compilations, by design); the next test gets it back."""
    on = bool(jax.config.jax_enable_compilation_cache)
    yield
    jax.config.update("jax_enable_compilation_cache", on)


@pytest.fixture(autouse=True)
def _restore_float_width():
    """Each test starts in the float width the session started in: a calibration run in-process
    switches JAX to float64 (`diffperf.calibrate` does, by design), which must not leak into the
    next test's float32 specs."""
    x64 = bool(jax.config.jax_enable_x64)
    yield
    jax.config.update("jax_enable_x64", x64)

# The CLI's on-disk compilation cache stays off in tests that call `main()` in-process (it would
# reconfigure JAX for the rest of the session and write to the home directory);
# tests/test_compile_cache.py turns it on in subprocesses.
os.environ.setdefault("DIFFPERF_COMPILATION_CACHE", "0")
# Commands the tests run in subprocesses run there, not in a `diffperf daemon` the developer may
# have running (tests/test_daemon.py starts its own).
os.environ["DIFFPERF_DAEMON"] = "0"


@pytest.fixture(scope="session")
def eff() -> dp.Efficiency:
    return dp.Efficiency()


@pytest.fixture(scope="session")
def dgx_a100() -> dp.System:
    return dp.system("dgx-a100")


@pytest.fixture(scope="session")
def dgx_h100() -> dp.System:
    return dp.system("dgx-h100")


@pytest.fixture(scope="session")
def gpt3() -> dp.Transformer:
    return dp.model("gpt3-175b")


@pytest.fixture(scope="session")
def gpt22b() -> dp.Transformer:
    return dp.model("gpt-22b")


@pytest.fixture(scope="session")
def step():
    """`train_step` jit-compiled once for scalar specs (shared by all test modules)."""
    return eqx.filter_jit(dp.train_step)
