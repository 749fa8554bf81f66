"""The daemon process of `diffperf daemon start` (diffperf/cli/_daemon.py).

It warms up, then runs the commands that clients (`diffperf.cli._daemon_client`) send over
its Unix socket, one at a time, each as a fresh `diffperf` process would: in the client's
working directory and environment, stdout / stderr sent back as frames, Python warnings shown
again for each command, the exit status last.

Two threads. A listener thread answers every connection at once: `status` / `stop` messages,
and a command with `a` (accepted; handed to the main thread) or `b` (busy with another
command: the client runs it itself). The main thread runs the accepted commands; before each
it parses the arguments with the real parser and sends `l` (run it locally) for `bench`,
`calibrate`, `daemon` and `--distributed` runs, abbreviated options included. While a command
runs, a watcher thread interrupts it (KeyboardInterrupt) when its client hangs up (Ctrl-C, a
closed pipe). The daemon exits after its idle time without a command (status requests do not
count), when its resident memory passes its limit after a command, or on `stop` (after the
command it is running).
"""

from __future__ import annotations

import _thread
import io
import json
import os
import queue
import select
import socket
import struct
import sys
import threading
import time
import traceback
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from . import _main
from ._daemon_client import HEADER, LOCAL_COMMANDS, MAX_REQUEST_BYTES, fingerprint, read_exact

#: Commands run once at start-up so that their programs are loaded before the first request
#: (output discarded).
WARM_UP = (["train", "--json"], ["infer", "--json"])
#: Seconds the listener waits for a connection's request before dropping it.
REQUEST_TIMEOUT_S = 5.0
#: Seconds between the main thread's checks of the idle time and of `stop`.
POLL_S = 0.5


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


def _frame(conn: socket.socket, tag: bytes, payload: bytes = b"") -> bool:
    try:
        conn.sendall(HEADER.pack(tag, len(payload)) + payload)
    except OSError:
        return False
    return True


def _resident_bytes() -> float:
    try:
        with open("/proc/self/statm") as f:
            return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0.0


def _receive(conn: socket.socket) -> dict | None:
    """The connection's request (a JSON object), or None if it is malformed or too slow."""
    try:
        head = read_exact(conn, 4)
        if head is None:
            return None
        (n,) = struct.unpack(">I", head)
        body = read_exact(conn, n) if n <= MAX_REQUEST_BYTES else None
        if body is None:
            return None
        message = json.loads(body.decode())
    except (OSError, ValueError):
        return None
    return message if isinstance(message, dict) else None


def _is_command(message: dict) -> bool:
    return (isinstance(message.get("argv"), list) and isinstance(message.get("cwd"), str)
            and isinstance(message.get("env"), dict)
            and all(isinstance(a, str) for a in message["argv"])
            and all(isinstance(k, str) and isinstance(v, str)
                    for k, v in message["env"].items()))


def runs_locally(argv: list[str]) -> bool:
    """True for a command the calling process must run (parsed as `diffperf` parses it, so
    `--distrib` is `--distributed`); a command line that does not parse runs here, where it
    prints the parser's error as a fresh process does."""
    sink = io.StringIO()
    try:
        with redirect_stdout(sink), redirect_stderr(sink):
            args = _main.build_parser().parse_args(argv)
    except SystemExit:
        return False
    return args.command in LOCAL_COMMANDS or bool(getattr(args, "distributed", False))


class _Daemon:
    def __init__(self, listener: socket.socket, path: Path, idle_s: float, max_rss: float):
        self.listener, self.path, self.idle_s, self.max_rss = listener, path, idle_s, max_rss
        self.inode = os.stat(path).st_ino  # the socket this daemon bound
        self.hung_up = threading.Event()  # the running command's client hung up
        self.commands: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.busy = False
        self.stopping = threading.Event()
        self.started = self.last = time.time()
        self.served = 0
        self.home = os.getcwd()

    # -------------------------------------------------------------------- listener thread
    def listen(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed: exiting
            conn.settimeout(REQUEST_TIMEOUT_S)
            message = _receive(conn)
            if message is None:
                conn.close()
                continue
            action = message.get("control")
            if action in ("status", "stop"):
                with self.lock:
                    busy = self.busy
                info = {"pid": os.getpid(), "commands": self.served, "busy": busy,
                        "interrupting": busy and self.hung_up.is_set(),
                        "rss_mib": _resident_bytes() / 2**20,
                        "uptime_s": time.time() - self.started, "idle_s": time.time() - self.last}
                try:
                    conn.sendall(json.dumps(info).encode())
                except OSError:
                    pass
                conn.close()
                if action == "stop":
                    self.stopping.set()
                continue
            with self.lock:
                accept = _is_command(message) and not self.busy
                self.busy = self.busy or accept
            if accept:
                conn.settimeout(None)  # the command's output goes at the client's pace
                self.commands.put((conn, message))
            else:
                _frame(conn, b"b")
                conn.close()

    # ------------------------------------------------------------------------ main thread
    def run(self) -> None:
        listener = threading.Thread(target=self.listen, name="diffperf-daemon-listener",
                                    daemon=True)
        listener.start()
        try:
            while not self.stopping.is_set():
                if time.time() - self.last > self.idle_s:
                    return
                try:
                    conn, message = self.commands.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                try:
                    self.command(conn, message)
                except KeyboardInterrupt:
                    # The watcher's interrupt came just after the command ended; any other
                    # (a SIGINT sent to the daemon) stops it.
                    if not self.hung_up.is_set():
                        raise
                finally:
                    conn.close()
                    self.last = time.time()
                    with self.lock:
                        self.busy = False
                if _resident_bytes() > self.max_rss:
                    print(f"resident memory {_resident_bytes() / 2**30:.1f} GiB above the "
                          "limit; exiting", file=sys.stderr)
                    return
        finally:
            self.stopping.set()
            self._close()

    def _close(self) -> None:
        """Close the listener; remove the socket only if it is still the one it bound (a
        daemon started after this one stopped answering may have replaced it)."""
        try:
            inode = os.stat(self.path).st_ino
        except OSError:
            inode = None
        self.listener.close()
        if inode == self.inode:
            self.path.unlink(missing_ok=True)

    def command(self, conn: socket.socket, message: dict) -> None:
        argv = message["argv"]
        if runs_locally(argv):
            _frame(conn, b"l")
            return
        if not _frame(conn, b"a"):
            return
        tty = message.get("tty") or [False, False]
        out = _FrameStream(conn, b"o", bool(tty[0]))
        err = _FrameStream(conn, b"e", bool(tty[1]))
        saved_env = dict(os.environ)
        done = threading.Event()
        wake_read, wake_write = os.pipe()  # ends the watcher's wait when the command ends
        self.hung_up.clear()
        watcher = threading.Thread(target=_watch, args=(conn, wake_read, done, self.hung_up),
                                   daemon=True)
        code: int | None = None
        try:
            os.environ.clear()
            os.environ.update(message["env"])
            try:
                os.chdir(message["cwd"])
            except OSError as e:
                err.write(f"error: cannot enter the working directory {message['cwd']}: "
                          f"{e.strerror}\n")
                code = 2
            else:
                watcher.start()
                code = _run(argv, out, err)
                self.served += 1
        except KeyboardInterrupt:
            code = None  # the client hung up while the command ran
        finally:
            done.set()
            os.write(wake_write, b"x")
            if watcher.is_alive():
                watcher.join()
            os.close(wake_read)
            os.close(wake_write)
            os.environ.clear()
            os.environ.update(saved_env)
            os.chdir(self.home)
        if code is not None and not self.hung_up.is_set():
            _frame(conn, b"x", str(code).encode())


def _watch(conn: socket.socket, wake: int, done: threading.Event,
           hung_up: threading.Event) -> None:
    """Interrupt the main thread's command if its client hangs up (the client sends nothing
    after its request, so a readable connection is a closed one); return when the pipe `wake`
    becomes readable (the command ended)."""
    watched = [conn, wake]
    while not done.is_set():
        readable, _, _ = select.select(watched, [], [])
        if conn in readable and not done.is_set():
            try:
                closed = conn.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                closed = True
            if closed:
                hung_up.set()
                _thread.interrupt_main()
                return
            watched = [wake]  # it sent more than its request: no longer watched


def _run(argv: list[str], out: _FrameStream, err: _FrameStream) -> int | None:
    """Run one command line as `diffperf` would; its exit status (None: the client left)."""
    with warnings.catch_warnings(), redirect_stdout(out), redirect_stderr(err):
        # catch_warnings resets the "shown once" registries: each command warns again.
        try:
            return int(_main.main(argv) or 0)
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                return e.code or 0
            print(e.code, file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            raise
        except BaseException:
            if out.broken or err.broken:
                return None
            traceback.print_exc()
            return 1


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
    os.chdir(path.parent)  # never a directory a user may delete
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    listener.settimeout(POLL_S)
    _Daemon(listener, path, idle_s, max_rss).run()


def serve_main() -> None:
    """The daemon process's entry: `serve(path, digest, idle_s, max_rss)` from sys.argv."""
    path, digest, idle, rss = sys.argv[1:5]
    serve(Path(path), digest, float(idle), float(rss))
