"""The daemon process of `diffperf daemon start` (diffperf/cli/_daemon.py): it warms up, then
runs the commands that clients (`diffperf.cli._daemon_client`) send over its Unix socket, one
at a time, each as a fresh `diffperf` process would: in the client's working directory and
environment, with stdout / stderr sent back as frames, warnings shown as in a fresh process,
and the exit status last. It exits after its idle time, when its resident memory passes its
limit (checked after each command), or on a `stop` message.
"""

from __future__ import annotations

import io
import json
import os
import socket
import struct
import sys
import time
import traceback
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from . import _main
from ._daemon_client import HEADER, fingerprint

#: Commands run once at start-up so that their programs are loaded before the first request
#: (output discarded).
WARM_UP = (["train", "--json"], ["infer", "--json"])


class _FrameStream(io.TextIOBase):
    """A text stream whose writes go to the client as frames tagged `tag`."""

    def __init__(self, conn: socket.socket, tag: bytes, tty: bool):
        self.conn, self.tag, self.tty, self.broken = conn, tag, tty, False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> int:
        data = s.encode("utf-8", "surrogateescape")
        if data:
            try:
                self.conn.sendall(HEADER.pack(self.tag, len(data)) + data)
            except OSError as e:
                self.broken = True
                raise BrokenPipeError("the diffperf client went away") from e
        return len(s)


def _resident_bytes() -> float:
    try:
        with open("/proc/self/statm") as f:
            return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0.0


def _run(argv: list[str], out: _FrameStream, err: _FrameStream) -> int | None:
    """Run one command line as `diffperf` would; its exit status (None: the client left)."""
    with warnings.catch_warnings(), redirect_stdout(out), redirect_stderr(err):
        # catch_warnings resets the "shown once" registries: each command warns as a fresh
        # process does.
        try:
            return int(_main.main(argv) or 0)
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                return e.code or 0
            print(e.code, file=sys.stderr)
            return 1
        except BaseException:
            if out.broken or err.broken:
                return None
            traceback.print_exc()
            return 1


def _handle(conn: socket.socket, message: dict) -> int:
    """Run the command in `message` in the client's directory and environment."""
    tty = message.get("tty", [False, False])
    out, err = _FrameStream(conn, b"o", bool(tty[0])), _FrameStream(conn, b"e", bool(tty[1]))
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    code: int | None
    try:
        os.environ.clear()
        os.environ.update(message["env"])
        os.chdir(message["cwd"])
    except OSError as e:
        code = 2
        err.write(f"error: the daemon cannot enter {message['cwd']}: {e.strerror}\n")
    else:
        code = _run([str(a) for a in message["argv"]], out, err)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
    if code is not None:
        try:
            conn.sendall(HEADER.pack(b"x", len(str(code))) + str(code).encode())
        except OSError:
            pass
    return 1


def _receive(conn: socket.socket) -> dict | None:
    head = conn.recv(4, socket.MSG_WAITALL)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    body = conn.recv(n, socket.MSG_WAITALL)
    try:
        message = json.loads(body.decode())
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def serve(path: Path, digest: str, idle_s: float, max_rss: float) -> None:
    """Warm up, then answer commands on the Unix socket `path` until idle, too large or
    stopped."""
    sink = io.StringIO()
    for argv in WARM_UP:
        with redirect_stdout(sink), redirect_stderr(sink):
            _main.main(list(argv))
    if fingerprint() != digest:  # the package changed while this process loaded it
        print("the package's files changed during start-up; not serving", file=sys.stderr)
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    listener.settimeout(idle_s)
    started, last, commands = time.time(), time.time(), 0
    try:
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                return
            with conn:
                conn.settimeout(None)
                message = _receive(conn)
                if message is None:
                    continue
                action = message.get("control")
                if action in ("status", "stop"):
                    info = {"pid": os.getpid(), "commands": commands,
                            "rss_mib": _resident_bytes() / 2**20,
                            "uptime_s": time.time() - started, "idle_s": time.time() - last}
                    try:
                        conn.sendall(json.dumps(info).encode())
                    except OSError:
                        pass
                    if action == "stop":
                        return
                    continue
                commands += _handle(conn, message)
                last = time.time()
            if _resident_bytes() > max_rss:
                print(f"resident memory {_resident_bytes() / 2**30:.1f} GiB above the limit; "
                      "exiting", file=sys.stderr)
                return
    finally:
        listener.close()
        path.unlink(missing_ok=True)


def serve_main() -> None:
    """The daemon process's entry: `serve(path, digest, idle_s, max_rss)` from sys.argv."""
    path, digest, idle, rss = sys.argv[1:5]
    serve(Path(path), digest, float(idle), float(rss))

