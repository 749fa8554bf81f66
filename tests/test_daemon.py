"""`diffperf daemon`: a command answered by a running daemon is the command a fresh process
runs (same stdout, stderr and exit status, files written where the caller is), and the client
uses a daemon only when it is safe (same code and JAX settings, a private directory, a live
socket)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diffperf.cli import _daemon_client as client
from diffperf.cli._daemon_server import runs_locally


def _run(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diffperf.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def _status(env: dict, cwd: Path) -> dict:
    out = _run(["daemon", "status", "--json"], env, cwd)
    rows = [r for r in json.loads(out.stdout) if r["matches_this_environment"]]
    assert len(rows) == 1, out.stdout
    return rows[0]


def _commands_served(env: dict, cwd: Path) -> int:
    return _status(env, cwd)["commands"]


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
def test_spec_files_are_read_again_where_the_path_names_another_file(daemon):
    """Two model files of the same relative name, size and modification time in two
    directories: each command reads its own (the loader's cache keys on the absolute path,
    inode and change time)."""
    env, local_env, work = daemon
    exported = _run(["presets", "export", "llama2-7b"], local_env, work)
    text = exported.stdout
    assert '"layers": 32' in text
    (work / "a").mkdir()
    (work / "b").mkdir()
    (work / "a" / "m.json").write_text(text)
    (work / "b" / "m.json").write_text(text.replace('"layers": 32', '"layers": 16'))
    stamp = (work / "a" / "m.json").stat()
    os.utime(work / "b" / "m.json", ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    args = ["infer", "--model", "m.json", "--json"]
    there = [_run(args, env, work / d) for d in ("a", "b")]
    here = [_run(args, local_env, work / d) for d in ("a", "b")]
    assert [t.stdout for t in there] == [h.stdout for h in here]
    assert there[0].stdout != there[1].stdout


@pytest.mark.slow
def test_a_busy_daemon_hands_the_command_back_and_a_hang_up_stops_its_command(daemon):
    """A command blocked reading a FIFO keeps the daemon busy for as long as the test needs:
    meanwhile another command runs in its caller; the blocked command's client is then
    interrupted, and when the FIFO delivers, the daemon drops the command (it would otherwise
    open the file again and block for ever) and serves the next one."""
    env, local_env, work = daemon
    before = _commands_served(env, work)
    reference = _run(["train", "--json"], local_env, work)
    fifo = work / "blocked.json"
    os.mkfifo(fifo)
    blocked = subprocess.Popen([sys.executable, "-m", "diffperf.cli", "train", "--model",
                                fifo.name, "--json"], env=env, cwd=work,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _status(env, work)["busy"]:
            assert time.monotonic() < deadline and blocked.poll() is None
            time.sleep(0.2)
        there = _run(["train", "--json"], env, work)  # the daemon is busy: runs here
        assert (there.returncode, there.stdout) == (reference.returncode, reference.stdout)
        assert _status(env, work)["busy"] and _commands_served(env, work) == before
    finally:
        blocked.send_signal(signal.SIGINT)
        blocked.wait(timeout=60)
    deadline = time.monotonic() + 60
    while not _status(env, work)["interrupting"]:  # the daemon saw the hang-up
        assert time.monotonic() < deadline, "the daemon did not see its client hang up"
        time.sleep(0.2)
    while _status(env, work)["busy"]:
        # Give the blocked read something: its pending interrupt fires when the read returns
        # (the reader may close the pipe before the write ends).
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # no reader (yet): ENXIO
        except OSError:
            pass
        else:
            with contextlib.suppress(OSError):
                os.write(fd, b"{}")
            os.close(fd)
        assert time.monotonic() < deadline, "the hung-up command was not interrupted"
        time.sleep(0.2)
    assert _commands_served(env, work) == before
    # a command from a directory deleted afterwards leaves the daemon as it was
    gone = work / "gone"
    gone.mkdir()
    assert _run(["train", "--json"], env, gone).returncode == 0
    gone.rmdir()
    assert _run(["train", "--json"], env, work).returncode == 0
    assert _commands_served(env, work) == before + 2


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


def test_the_fingerprint_follows_the_settings(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_ENABLE_X64", raising=False)
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    base = client.fingerprint()
    assert client.fingerprint() == base
    for key, value in (("JAX_ENABLE_X64", "1"), ("PYTHONWARNINGS", "error"),
                       ("DIFFPERF_COMPILATION_CACHE", str(tmp_path))):
        with monkeypatch.context() as m:
            m.setenv(key, value)
            assert client.fingerprint() != base, key
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")  # JAX sets it on import: not a setting
    assert client.fingerprint() == base


def test_the_daemon_parses_before_it_runs_a_command_that_must_stay_local():
    """Abbreviated options are what argparse makes of them: `--distrib` is `--distributed`."""
    assert runs_locally(["search", "train", "--distrib"])
    assert runs_locally(["calibrate", "--out", "fit.json", "--quiet"])
    assert not runs_locally(["search", "train"])
    assert not runs_locally(["train", "--no-such-option"])  # runs, and prints argparse's error


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
