"""The client side of `diffperf daemon`: hand one command to a running daemon, stdlib only.

A fresh `diffperf train` spends about 1.5 s before it predicts anything: the interpreter,
`import jax` (0.5 s), equinox and the package, and loading the stored XLA program (0.4-0.5 s;
docs/speed.md). A daemon started with `diffperf daemon start` has paid all of that once; this
module, which imports nothing but the standard library, sends it the command line (arguments,
working directory, environment) over a Unix socket and copies back what the command writes to
stdout and stderr, and its exit status.

A daemon is used only when it runs the same code in the same setting: its socket's name carries
a fingerprint of the Python interpreter, the package's files (path, size, modification time:
an edited or reinstalled package does not match) and every `JAX_*` / `XLA_*` variable, which
JAX reads once at start-up. Anything else runs in this process as before: no daemon, a
`DIFFPERF_DAEMON=0` environment, the commands that change the process (`calibrate` switches
JAX to float64, `bench` times fresh processes, `--distributed` joins a multi-process job), or
a daemon that does not answer.

Frames from the daemon: one tag byte (`o` stdout, `e` stderr, `x` exit status), a 4-byte
big-endian length, the payload.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
import struct
import sys
from pathlib import Path

#: Commands always run in the calling process (see the module docstring).
LOCAL_COMMANDS = frozenset({"daemon", "bench", "calibrate"})
#: Options that make a command run in the calling process.
LOCAL_OPTIONS = frozenset({"--distributed"})
#: Values of `DIFFPERF_DAEMON` that stop commands from using a running daemon.
OFF = ("0", "off", "false", "no")
#: Prefixes of the environment variables in the fingerprint (read once when JAX starts; not
#: TF_CPP_*, which JAX itself sets on import).
SETTING_PREFIXES = ("JAX_", "XLA_")
#: Package files in the fingerprint.
CODE_SUFFIXES = (".py", ".json", ".csv")
HEADER = struct.Struct(">cI")


def socket_directory() -> Path:
    """`$XDG_RUNTIME_DIR/diffperf` (else `<tmp>/diffperf-<uid>`): private to the user."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "diffperf"
    tmp = os.environ.get("TMPDIR") or "/tmp"
    return Path(tmp) / f"diffperf-{os.getuid()}"


def directory_is_private(path: Path) -> bool:
    """True if `path` is a directory owned by this user that no one else can enter or write."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & 0o077)


def fingerprint() -> str:
    """Hex digest of what a daemon's answers depend on besides the command line: the
    interpreter, the package's files (relative path, size, modification time) and the
    `JAX_*` / `XLA_*` environment."""
    h = hashlib.sha256()
    h.update(f"{sys.executable}\0{sys.version}\0".encode())
    root = Path(__file__).resolve().parent.parent
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(CODE_SUFFIXES):
                st = os.stat(os.path.join(dirpath, name))
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for key in sorted(k for k in os.environ if k.startswith(SETTING_PREFIXES)):
        h.update(f"{key}={os.environ[key]}\0".encode())
    return h.hexdigest()[:24]


def socket_path(digest: str | None = None) -> Path:
    """The socket of the daemon that matches this process's code and settings."""
    return socket_directory() / f"daemon-{digest or fingerprint()}.sock"


def runs_locally(argv: list[str]) -> bool:
    """True when `argv` must run in the calling process whatever daemon runs."""
    if os.environ.get("DIFFPERF_DAEMON", "").strip().lower() in OFF:
        return True
    command = next((a for a in argv if not a.startswith("-")), None)
    return command in LOCAL_COMMANDS or any(a.split("=")[0] in LOCAL_OPTIONS for a in argv)


def request(argv: list[str]) -> dict:
    """The message for one command: arguments, working directory, environment, and whether
    stdout / stderr are terminals (progress bars and widths follow them)."""
    env = dict(os.environ)
    tty = [sys.stdout.isatty(), sys.stderr.isatty()]
    if tty[0] or tty[1]:
        size = shutil.get_terminal_size()
        env.setdefault("COLUMNS", str(size.columns))
        env.setdefault("LINES", str(size.lines))
    return {"argv": argv, "cwd": os.getcwd(), "env": env, "tty": tty}


def _read_exact(conn: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        data = conn.recv(left)
        if not data:
            return None
        chunks.append(data)
        left -= len(data)
    return b"".join(chunks)


def connect(path: Path, timeout: float | None = 2.0) -> socket.socket | None:
    """A connection to the daemon at `path`, or None if there is none that is safe to use."""
    if not directory_is_private(path.parent):
        return None
    try:
        if not stat.S_ISSOCK(path.lstat().st_mode):
            return None
    except OSError:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        conn.connect(str(path))
    except OSError:
        conn.close()
        return None
    return conn


def send(conn: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    conn.sendall(struct.pack(">I", len(body)) + body)


def run_in_daemon(argv: list[str]) -> int | None:
    """Run `argv` in the matching daemon and return its exit status, or None when it must run
    here (no daemon, a local command, the daemon went away before answering)."""
    if runs_locally(argv):
        return None
    conn = connect(socket_path())
    if conn is None:
        return None
    out, err = sys.stdout.buffer, sys.stderr.buffer
    started = False
    try:
        send(conn, request(argv))
        conn.settimeout(None)  # a command takes as long as it takes
        while True:
            header = _read_exact(conn, HEADER.size)
            if header is None:
                break
            tag, n = HEADER.unpack(header)
            payload = _read_exact(conn, n)
            if payload is None:
                break
            if tag == b"x":
                return int(payload)
            started = True
            stream = out if tag == b"o" else err
            stream.write(payload)
            stream.flush()
    except BrokenPipeError:
        # Our reader went away (`diffperf train | head`): stop quietly, as the local run does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError:
        pass
    finally:
        conn.close()
    if not started:
        return None  # nothing happened there: run it here
    print("error: the diffperf daemon stopped while running the command", file=sys.stderr)
    return 1
