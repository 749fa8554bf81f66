"""`diffperf daemon start | stop | status`: a background process that keeps JAX, the package
and the compiled programs loaded, so that each later `diffperf` command answers in a tenth of
a second instead of 1.5-2 s (docs/speed.md). The client is `diffperf.cli._daemon_client`, the
daemon process `diffperf.cli._daemon_server`.

The daemon runs one command at a time, as the calling process would have: in the caller's
working directory and environment, with its stdout and stderr sent back, Python warnings shown
again for each command, and the exit status returned; a command that arrives while it is busy
runs in the calling process. It listens on a Unix socket in a directory private to the user,
whose name carries the fingerprint of the code, the installed dependencies and the settings it
loaded (anything else does not match it, and runs locally). It exits after `--idle-minutes`
without a command, when its resident memory passes `--max-memory-gib` (checked after each
command), or on `diffperf daemon stop`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

from ._common import CliError
from ._daemon_client import (
    connect,
    directory_is_private,
    fingerprint,
    send,
    socket_directory,
    socket_path,
)

#: Minutes without a command after which the daemon exits.
IDLE_MINUTES = 30.0
#: Resident memory above which the daemon exits after a command (compiled programs of many
#: different models accumulate), GiB.
MAX_MEMORY_GIB = 4.0
#: Largest values of the options (a year; 1 TiB).
LIMITS = {"--idle-minutes": 525_600.0, "--max-memory-gib": 1024.0}
#: Seconds `daemon start` waits for the daemon to load and warm up before giving up.
START_TIMEOUT_S = 300.0
#: What the daemon process runs (diffperf/cli/_daemon_server.py).
SERVER = "from diffperf.cli._daemon_server import serve_main; serve_main()"


def add_daemon_parser(sub) -> None:
    p = sub.add_parser(
        "daemon", help="keep JAX and the compiled programs loaded in a background process, "
                       "so later commands answer in ~0.1 s",
        description="Start, stop or list background processes that run diffperf commands. "
                    "While one runs, every diffperf command started with the same code and "
                    "JAX settings (except bench, calibrate and --distributed runs) runs in it, "
                    "with the same output. DIFFPERF_DAEMON=0 runs a command here instead.")
    p.add_argument("action", choices=("start", "stop", "status"),
                   help="start one for this code and environment; stop it (--all: every one "
                        "of this user's); list them")
    p.add_argument("--idle-minutes", type=float, default=IDLE_MINUTES,
                   help=f"exit after this long without a command (default {IDLE_MINUTES:g})")
    p.add_argument("--max-memory-gib", type=float, default=MAX_MEMORY_GIB,
                   help="exit after a command that leaves more resident memory than this "
                        f"(default {MAX_MEMORY_GIB:g})")
    p.add_argument("--all", action="store_true", help="stop: every daemon of this user")
    p.add_argument("--json", action="store_true", help="status: as JSON")
    p.set_defaults(func=cmd_daemon)


def cmd_daemon(args) -> int:
    for option, value in (("--idle-minutes", args.idle_minutes),
                          ("--max-memory-gib", args.max_memory_gib)):
        if not (math.isfinite(value) and 0 < value <= LIMITS[option]):
            raise CliError(f"{option} must be a number in (0, {LIMITS[option]:g}], got "
                           f"{value:g}")
    if args.action == "start":
        return _start(args.idle_minutes * 60.0, args.max_memory_gib * 2**30)
    if args.action == "stop":
        return _stop(args.all)
    return _status(args.json)


def _private_directory() -> Path:
    path = socket_directory()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not directory_is_private(path):
        raise CliError(f"{path} must be a directory of this user that no one else can enter "
                       "(mode 700); the daemon will not listen there")
    return path


def _control(path: Path, action: str) -> dict | None:
    """Send a control message; the daemon's answer, or None if none answers at `path`."""
    conn = connect(path, timeout=10.0)
    if conn is None:
        return None
    try:
        send(conn, {"control": action})
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    except OSError:
        return None
    finally:
        conn.close()
    try:
        return json.loads(data.decode())
    except ValueError:
        return None


def _start(idle_s: float, max_rss: float) -> int:
    directory = _private_directory()
    digest = fingerprint()
    path = socket_path(digest)
    if (info := _control(path, "status")) is not None:
        print(f"a diffperf daemon already runs for this code and environment "
              f"(pid {info['pid']}, socket {path})")
        return 0
    if path.exists():
        if (conn := connect(path)) is not None:  # something listens but is no daemon
            conn.close()
            raise CliError(f"a process listens at {path} but does not answer as a diffperf "
                           "daemon; stop it (its pid is in `fuser` / `ss -xlp`) or remove the "
                           "socket")
        path.unlink(missing_ok=True)  # a socket left by a daemon that died
    log = directory / f"daemon-{digest}.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(path), digest, repr(idle_s), repr(max_rss)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
            close_fds=True, cwd=directory)
    print(f"starting a diffperf daemon (pid {process.pid}): loading JAX and warming up ...",
          file=sys.stderr, flush=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise CliError(f"the daemon exited with status {process.returncode} while starting; "
                           f"see {log}")
        if (info := _control(path, "status")) is not None:
            print(f"diffperf daemon running (pid {info['pid']}, socket {path}); commands run "
                  f"with this code and JAX settings now use it; it exits after "
                  f"{idle_s / 60:g} idle minutes or `diffperf daemon stop`")
            return 0
        time.sleep(0.1)
    process.terminate()
    raise CliError(f"the daemon did not start within {START_TIMEOUT_S:g} s; see {log}")


def _sockets() -> list[Path]:
    directory = socket_directory()
    if not directory_is_private(directory):
        return []
    return sorted(directory.glob("daemon-*.sock"))


def _stop(every: bool) -> int:
    paths = _sockets() if every else [socket_path()]
    answers = {p: _control(p, "stop") for p in paths}
    stopped = [p for p, info in answers.items() if info is not None]
    for p in stopped:
        busy = answers[p].get("busy")  # type: ignore[union-attr]
        print(f"stopped the daemon at {p}" + (" (it exits when its running command ends)"
                                              if busy else ""))
    if not stopped:
        print("no diffperf daemon was running" + ("" if every else
              " for this code and environment (--all: every one of this user's)"))
    return 0


def _status(as_json: bool) -> int:
    mine = socket_path()
    rows = []
    for path in _sockets():
        info = _control(path, "status")
        if info is not None:
            rows.append({**info, "socket": str(path), "matches_this_environment": path == mine})
    if as_json:
        print(json.dumps(rows, indent=2))
    elif not rows:
        print("no diffperf daemon is running")
    for r in rows if not as_json else []:
        print(f"pid {r['pid']}: commands served {r['commands']}"
              + (" (running one now)" if r.get("busy") else "") + f", {r['rss_mib']:.0f} MiB, up "
              f"{r['uptime_s']:.0f} s, idle {r['idle_s']:.0f} s, "
              + ("used by commands from this environment" if r["matches_this_environment"]
                 else "another code version or JAX setting") + f" ({r['socket']})")
    return 0



__all__ = ["add_daemon_parser", "cmd_daemon"]
