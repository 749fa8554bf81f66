"""The client side of `diffperf daemon`: hand one command to a running daemon, stdlib only.

A fresh `diffperf train` spends about 1.5 s before it predicts anything: the interpreter,
`import jax` (0.5 s), equinox and the package, and loading the stored XLA program (0.4-0.5 s;
docs/speed.md). A daemon started with `diffperf daemon start` has paid all of that once; this
module, which imports nothing but the standard library, sends it the command line (arguments,
working directory, environment) over a Unix socket and copies back what the command writes to
stdout and stderr, and its exit status.

A daemon is used only when it runs the same code in the same setting: its socket's name carries
a fingerprint (`fingerprint`) of the Python interpreter, the package's files, the
distributions installed on `sys.path` (installing or upgrading a dependency changes it), the
compilation cache the command would use, and the `JAX_*`, `XLA_*` and `PYTHON*` variables
(read once at start-up). Anything else runs in this process as before: no daemon,
`DIFFPERF_DAEMON=0`, a daemon busy with another command or that does not answer at once, and
the commands that change the process
(`calibrate` switches JAX to float64, `bench` times fresh processes, `--distributed` joins a
multi-process job; the daemon checks these again with the real parser, abbreviations included).

Frames from the daemon: one tag byte, a 4-byte big-endian length, the payload. First one of
`a` (accepted: it runs the command), `b` (busy) or `l` (run it locally); then `o` (stdout) and
`e` (stderr) chunks, and `x` with the exit status.
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

from ._cache_path import cache_directory

#: Commands always run in the calling process (see the module docstring).
LOCAL_COMMANDS = frozenset({"daemon", "bench", "calibrate"})
#: Options that make a command run in the calling process.
LOCAL_OPTIONS = frozenset({"--distributed"})
#: Values of `DIFFPERF_DAEMON` that stop commands from using a running daemon.
OFF = ("0", "off", "false", "no")
#: Prefixes of the environment variables in the fingerprint (read once when the interpreter
#: or JAX starts; not TF_CPP_*, which JAX itself sets on import).
SETTING_PREFIXES = ("JAX_", "XLA_", "PYTHON")
#: Entries of a `sys.path` directory that name the distributions installed there (with their
#: versions: `jax-0.10.2.dist-info`), in the fingerprint.
INSTALLED_SUFFIXES = (".dist-info", ".egg-info", ".egg-link", ".pth")
#: Package files in the fingerprint.
CODE_SUFFIXES = (".py", ".json", ".csv")
HEADER = struct.Struct(">cI")
#: Seconds a client waits for the daemon to accept (or refuse) a command before running it
#: here; the daemon answers at once, even while it runs another command.
ACCEPT_TIMEOUT_S = 5.0
#: Largest request a daemon reads, bytes.
MAX_REQUEST_BYTES = 64 * 2**20


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
    interpreter, the package's files (relative path, size, modification time) and where it
    lies, the distributions installed on `sys.path` with their versions, the compilation
    cache directory, and the `JAX_*`, `XLA_*` and `PYTHON*` environment."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    h.update(f"{sys.executable}\0{sys.version}\0{root}\0{cache_directory()}\0".encode())
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        files += [os.path.join(dirpath, n) for n in filenames if n.endswith(CODE_SUFFIXES)]
    for path in sorted(files):
        st = os.stat(path)
        h.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for entry in sys.path[1:]:  # [0]: the script's directory or the working directory
        try:
            installed = sorted(n for n in os.listdir(entry) if n.endswith(INSTALLED_SUFFIXES))
        except OSError:
            installed = []
        h.update(f"{entry}\0{installed}\0".encode())
    for key in sorted(k for k in os.environ if k.startswith(SETTING_PREFIXES)):
        h.update(f"{key}={os.environ[key]}\0".encode())
    return h.hexdigest()[:24]


def socket_path(digest: str | None = None) -> Path:
    """The socket of the daemon that matches this process's code and settings."""
    return socket_directory() / f"daemon-{digest or fingerprint()}.sock"


def runs_locally(argv: list[str]) -> bool:
    """True when `argv` must run in the calling process whatever daemon runs (the daemon also
    checks with the real parser, so an abbreviated `--distrib` runs locally too)."""
    if os.environ.get("DIFFPERF_DAEMON", "").strip().lower() in OFF:
        return True
    command = next((a for a in argv if not a.startswith("-")), None)
    return command in LOCAL_COMMANDS or any(a.split("=")[0] in LOCAL_OPTIONS for a in argv)


def request(argv: list[str]) -> dict:
    """The message for one command: arguments, working directory, environment, and whether
    stdout / stderr are terminals (sweep progress lines and widths follow them)."""
    env = dict(os.environ)
    tty = [sys.stdout.isatty(), sys.stderr.isatty()]
    if tty[0] or tty[1]:
        size = shutil.get_terminal_size()
        env.setdefault("COLUMNS", str(size.columns))
        env.setdefault("LINES", str(size.lines))
    return {"argv": argv, "cwd": os.getcwd(), "env": env, "tty": tty}


def read_exact(conn: socket.socket, n: int) -> bytes | None:
    """`n` bytes from `conn`, or None if it closes first."""
    chunks, left = [], n
    while left:
        data = conn.recv(min(left, 1 << 20))
        if not data:
            return None
        chunks.append(data)
        left -= len(data)
    return b"".join(chunks)


def read_frame(conn: socket.socket) -> tuple[bytes, bytes] | None:
    """(tag, payload) of the next frame, or None if the connection closes first."""
    header = read_exact(conn, HEADER.size)
    if header is None:
        return None
    tag, n = HEADER.unpack(header)
    payload = read_exact(conn, n)
    return None if payload is None else (tag, payload)


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
    here (no daemon, a local command, a busy or silent daemon, a closed stdout)."""
    if runs_locally(argv) or sys.stdout is None or sys.stderr is None:
        return None
    conn = connect(socket_path())
    if conn is None:
        return None
    try:
        return _exchange(conn, argv)
    finally:
        conn.close()


def _exchange(conn: socket.socket, argv: list[str]) -> int | None:
    try:
        out, err = sys.stdout.buffer, sys.stderr.buffer
        send(conn, request(argv))
        conn.settimeout(ACCEPT_TIMEOUT_S)
        first = read_frame(conn)
    except (OSError, ValueError, AttributeError):
        return None
    if first is None or first[0] != b"a":
        return None  # busy, a command to run here, or no answer: run it here
    try:
        conn.settimeout(None)  # a command takes as long as it takes
        while (frame := read_frame(conn)) is not None:
            tag, payload = frame
            if tag == b"x":
                return int(payload)
            stream = out if tag == b"o" else err
            stream.write(payload)
            stream.flush()
    except BrokenPipeError:
        # Our reader went away (`diffperf train | head`): stop quietly, as a local run does;
        # closing the connection stops the command in the daemon.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    except KeyboardInterrupt:
        return 130  # closing the connection interrupts the command in the daemon
    except OSError:
        pass
    print("error: the diffperf daemon stopped while running the command (its log is in "
          f"{socket_directory()})", file=sys.stderr)
    return 1
