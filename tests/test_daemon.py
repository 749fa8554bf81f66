"""`diffperf daemon`: a command answered by a running daemon is the command a fresh process
runs (same stdout, stderr and exit status, files written where the caller is), and the client
uses a daemon only when it is safe (same code and JAX settings, a private directory, a live
socket)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from diffperf.cli import _daemon_client as client


def _run(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diffperf.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def _commands_served(env: dict, cwd: Path) -> int:
    out = _run(["daemon", "status", "--json"], env, cwd)
    rows = [r for r in json.loads(out.stdout) if r["matches_this_environment"]]
    assert len(rows) == 1, out.stdout
    return rows[0]["commands"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """(environment that reaches the daemon, the same with DIFFPERF_DAEMON=0, a working
    directory); the daemon runs in a private runtime directory of its own."""
    tmp = tmp_path_factory.mktemp("daemon")
    run_dir = tmp / "run"
    run_dir.mkdir(mode=0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(run_dir),
               DIFFPERF_COMPILATION_CACHE=str(tmp / "cache"))
    env.pop("DIFFPERF_DAEMON", None)
    work = tmp / "work"
    work.mkdir()
    started = _run(["daemon", "start"], env, work)
    assert started.returncode == 0, started.stderr
    try:
        yield env, {**env, "DIFFPERF_DAEMON": "0"}, work
    finally:
        _run(["daemon", "stop", "--all"], env, work)


def test_a_command_in_the_daemon_prints_what_a_fresh_process_prints(daemon):
    env, local_env, work = daemon
    before = _commands_served(env, work)
    for args in (["train", "--json"], ["train", "--gpu", "no-such-gpu"]):
        here, there = _run(args, local_env, work), _run(args, env, work)
        assert (there.returncode, there.stdout, there.stderr) == (
            here.returncode, here.stdout, here.stderr), args
    assert here.returncode == 2 and "no-such-gpu" in here.stderr
    assert _commands_served(env, work) == before + 2  # both went to the daemon


@pytest.mark.slow
def test_more_commands_match_and_files_land_in_the_callers_directory(daemon):
    env, local_env, work = daemon
    before = _commands_served(env, work)
    commands = (["infer"], ["train", "--help"], ["presets", "--json"],
                ["train", "--tp", "0"], ["serve", "--num-requests", "20", "--json"])
    for args in commands:
        here, there = _run(args, local_env, work), _run(args, env, work)
        assert (there.returncode, there.stdout, there.stderr) == (
            here.returncode, here.stdout, here.stderr), args
    sub = work / "sub"
    sub.mkdir()
    out = _run(["presets", "export", "h100-sxm5-80gb", "--out", "h100.json"], env, sub)
    assert out.returncode == 0, out.stderr
    local = _run(["presets", "export", "h100-sxm5-80gb"], local_env, sub)
    assert (sub / "h100.json").read_text().strip() == local.stdout.strip()
    assert _commands_served(env, work) == before + len(commands) + 1


@pytest.mark.slow
def test_other_jax_settings_or_daemon_off_run_in_the_calling_process(daemon):
    env, local_env, work = daemon
    before = _commands_served(env, work)
    for other in ({**env, "JAX_LOG_COMPILES": "0"}, local_env):
        out = _run(["train", "--json"], other, work)
        assert out.returncode == 0, out.stderr
    assert _commands_served(env, work) == before


def test_commands_that_change_the_process_always_run_locally(monkeypatch):
    monkeypatch.delenv("DIFFPERF_DAEMON", raising=False)
    for argv in (["calibrate"], ["bench", "cli"], ["daemon", "stop"],
                 ["search", "train", "--distributed"], ["--json", "bench"]):
        assert client.runs_locally(argv), argv
    for argv in (["train"], ["search", "train"], ["validate", "--data", "x.csv"]):
        assert not client.runs_locally(argv), argv
    monkeypatch.setenv("DIFFPERF_DAEMON", "0")
    assert client.runs_locally(["train"])


def test_the_fingerprint_follows_the_jax_settings(monkeypatch):
    monkeypatch.delenv("JAX_ENABLE_X64", raising=False)
    base = client.fingerprint()
    assert client.fingerprint() == base
    monkeypatch.setenv("JAX_ENABLE_X64", "1")
    assert client.fingerprint() != base
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")  # JAX sets it on import: not a setting
    monkeypatch.delenv("JAX_ENABLE_X64")
    assert client.fingerprint() == base


def test_no_connection_to_a_shared_directory_or_a_dead_socket(tmp_path):
    directory = tmp_path / "diffperf"
    directory.mkdir(mode=0o700)
    path = directory / "daemon-x.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    conn = client.connect(path)
    assert conn is not None
    conn.close()
    directory.chmod(0o755)  # others may enter: not trusted
    assert client.connect(path) is None
    directory.chmod(0o700)
    listener.close()  # the socket file stays, nobody listens
    assert path.exists() and client.connect(path) is None
    assert client.connect(directory / "daemon-missing.sock") is None
