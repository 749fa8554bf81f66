"""The command line's on-disk compilation cache: where it lives, that it is private, that a
second run reuses it with identical output, and that it can be turned off."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from diffperf.internal import cache_directory

TRAIN = ["-m", "diffperf.cli", "train", "--model", "gpt3-175b", "--gpus", "64", "--tp", "8",
         "--pp", "8", "--global-batch", "64", "--json"]


def _run(env_cache, tmp_path):
    env = dict(os.environ, DIFFPERF_COMPILATION_CACHE=env_cache, XDG_CACHE_HOME=str(tmp_path))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, *TRAIN], env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout


def test_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFPERF_COMPILATION_CACHE", "0")
    assert cache_directory() is None
    monkeypatch.setenv("DIFFPERF_COMPILATION_CACHE", "off")
    assert cache_directory() is None
    monkeypatch.setenv("DIFFPERF_COMPILATION_CACHE", str(tmp_path / "c"))
    assert cache_directory() == tmp_path / "c"
    monkeypatch.delenv("DIFFPERF_COMPILATION_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_directory() == tmp_path / "diffperf" / "jax"


@pytest.mark.slow
def test_second_run_reuses_the_private_cache_with_identical_output(tmp_path):
    cache = tmp_path / "jaxcache"
    first = _run(str(cache), tmp_path)
    entries = sorted(p.name for p in cache.iterdir())
    assert entries, "the first run wrote no compiled program"
    assert stat.S_IMODE(cache.stat().st_mode) & 0o077 == 0  # private to the user
    second = _run(str(cache), tmp_path)
    assert second == first
    assert sorted(p.name for p in cache.iterdir()) == entries  # all hits, nothing new


@pytest.mark.slow
def test_turned_off_writes_nothing(tmp_path):
    _run("0", tmp_path)
    assert not (tmp_path / "diffperf").exists()


@pytest.mark.slow
def test_a_directory_others_can_write_is_not_trusted(tmp_path):
    cache = tmp_path / "shared"
    cache.mkdir()
    os.chmod(cache, 0o777)
    _run(str(cache), tmp_path)
    assert not any(cache.iterdir())


def test_disabled_for_benchmarks_even_with_jax_cache_set(tmp_path):
    """`diffperf bench` measures cold: `disable_compilation_cache` keeps a cache set through
    JAX_COMPILATION_CACHE_DIR unused (the control run without it does write there)."""
    code = ("import sys, jax, jax.numpy as jnp\n"
            "from diffperf.internal import disable_compilation_cache\n"
            "if sys.argv[1] == 'off': disable_compilation_cache()\n"
            "jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready()\n")
    for mode in ("off", "on"):
        cache = tmp_path / mode
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        subprocess.run([sys.executable, "-c", code, mode], env=env, check=True)
        written = cache.exists() and any(cache.iterdir())
        assert written == (mode == "on"), mode


@pytest.mark.slow
def test_stored_programs_skip_the_trace_and_survive_a_warm_jax_cache(tmp_path):
    """The train step is stored with its arguments' structure (`diffperf._stored_programs`) and
    loaded by the next run. Stored again while JAX's own cache holds it (the programs deleted,
    as after a change to the sources that leaves the program alone), it is compiled afresh: an
    executable loaded from JAX's cache serializes incompletely and failed when run."""
    cache = tmp_path / "jaxcache"
    first = _run(str(cache), tmp_path)
    # the train step's program (the notes' small program is stored beside it)
    (stored,) = [f for f in (cache / "programs").iterdir()
                 if f.name.startswith("_jitted_train_step-")]
    assert _run(str(cache), tmp_path) == first
    stored.unlink()
    assert _run(str(cache), tmp_path) == first  # stores it again, from a warm JAX cache
    written = stored.stat().st_mtime_ns
    assert _run(str(cache), tmp_path) == first  # and runs what it stored (a defective file
    assert stored.stat().st_mtime_ns == written  # would be replaced)
