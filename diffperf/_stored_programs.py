"""Compiled programs stored on disk with the arguments' structure that selects them, so that a
later process skips tracing and lowering as well as compiling (`stored_jit`).

JAX's persistent compilation cache (`diffperf/cli/_compile_cache.py`) keys a program by its
lowered text, so every process still traces and lowers the function first: for one
`train_step`, 0.7-1.0 s of a 2-3 s `diffperf train` on a 2-core CPU, more than the cache saves
on compiling. A `stored_jit` function is keyed instead by what determines its trace: the
function, the package's source files (every `.py` and `.json` under `diffperf/`), the versions of
Python, jax, jaxlib, equinox and numpy, the JAX settings that change a trace, the device, and
the arguments' pytree structure (static fields included) and leaf shapes and dtypes. On a hit
the stored executable is loaded and called: the same program, so the same numbers, as
`jax.jit` would give. Anything unexpected (no directory, an unreadable or stale file, an
argument the key cannot describe) falls back to `jax.jit`.

Off unless a directory is set (`set_directory`, done by the command line with its compilation
cache): a library should not write files of its own accord. The directory must be private to
the user, as JAX's cache directory: stored programs are loaded with `pickle`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import platform
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import equinox as eqx
import jax
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

#: Where programs are stored; None: nowhere (plain `jax.jit`).
_directory: list[Path | None] = [None]
#: JAX settings that change what a trace produces.
_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion",
             "jax_numpy_dtype_promotion", "jax_default_prng_impl", "jax_enable_checks",
             "jax_debug_nans", "jax_debug_infs", "jax_disable_jit", "jax_platforms")
#: Programs kept per function (the newest), each a few MB.
KEEP = 8
#: Version 1 of the file format: a pickled (serialized executable, output skeleton).
_FORMAT = b"diffperf-stored-program-1"


def set_directory(path: Path | None) -> None:
    """Store and load programs in `path` (None: turn it off)."""
    _directory[0] = path


@functools.cache
def _environment() -> bytes:
    """Everything but the arguments that a key depends on, hashed once per process."""
    h = hashlib.sha256(_FORMAT)
    root = Path(__file__).resolve().parent
    for path in sorted(p for ext in ("*.py", "*.json") for p in root.rglob(ext)):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    versions = [sys.version, platform.machine()]
    for dist in ("jax", "jaxlib", "equinox", "numpy"):
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{dist} ?")
    device = jax.devices()[0]
    versions += [f"{k}={getattr(jax.config, k)!r}" for k in _SETTINGS]
    versions += [device.platform, device.device_kind, str(jax.device_count()),
                 os.environ.get("XLA_FLAGS", "")]
    h.update(repr(versions).encode())
    return h.digest()


@contextlib.contextmanager
def _fresh_compilation():
    """Compile afresh, not from JAX's persistent compilation cache: an executable loaded from
    there serializes incompletely (XLA:CPU, jax 0.10.2: the copy fails when run, "Function
    wrapped_divide.12 not found")."""
    enabled = jax.config.jax_enable_compilation_cache
    compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()  # the next compilation sets the cache up again


def _skeleton(tree):
    """`tree` with every leaf replaced by 0: its structure, static fields included, as a
    picklable object."""
    return jax.tree.map(lambda _: 0, tree)


def _key(fun, dynamic, static, options) -> str:
    avals = [(tuple(a.shape), str(a.dtype), bool(a.weak_type))
             for a in map(jax.api_util.shaped_abstractify, jax.tree.leaves(dynamic))]
    h = hashlib.sha256(_environment())
    h.update(f"{fun.__module__}.{fun.__qualname__} {options!r}".encode())
    h.update(pickle.dumps((_skeleton(dynamic), static), protocol=5))
    h.update(repr(avals).encode())
    return h.hexdigest()


class _StoredJit:
    """`jax.jit(fun)` (or with `filter`, `equinox.filter_jit(fun)`: only array leaves are
    traced, the rest are compile-time constants), with `compiler_options`."""

    def __init__(self, fun, compiler_options: dict | None = None, filter: bool = False):
        self.fun, self.options, self.filter = fun, compiler_options, filter
        self.plain = (eqx.filter_jit(fun, compiler_options=compiler_options)  # type: ignore[call-overload]
                      if filter else jax.jit(fun, compiler_options=compiler_options))
        self.loaded: dict[str, object] = {}  # key -> loaded executable, in this process
        functools.update_wrapper(self, fun)

    def __call__(self, *args, **kwargs):
        directory = _directory[0]
        if directory is None or jax.config.jax_disable_jit:
            return self.plain(*args, **kwargs)
        try:
            if self.filter:
                dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
            else:
                dynamic, static = (args, kwargs), None
            key = _key(self.fun, dynamic, static, self.options)
        except Exception:  # e.g. a constant that cannot be pickled: the plain jit decides
            return self.plain(*args, **kwargs)
        path = directory / f"{self.fun.__name__}-{key}.program"
        compiled = self.loaded.get(key)
        if compiled is None and (compiled := self._load(path, dynamic)) is not None:
            try:  # a program that cannot run (a defective file) is replaced
                out = jax.block_until_ready(compiled(dynamic))
                self.loaded[key] = compiled
                return out
            except jax.errors.JaxRuntimeError:
                compiled = None
        if compiled is None:
            compiled = self._compile_and_store(path, dynamic, static)
        self.loaded[key] = compiled
        return compiled(dynamic)

    @staticmethod
    def _load(path: Path, dynamic):
        try:
            with open(path, "rb") as fh:
                if fh.read(len(_FORMAT)) != _FORMAT:
                    return None
                serialized, out_skeleton = pickle.load(fh)
            return serialize_executable.deserialize_and_load(
                serialized, jax.tree.structure(((dynamic,), {})),
                jax.tree.structure(out_skeleton))
        except Exception:  # missing, truncated, unloadable: trace instead
            return None

    def _compile_and_store(self, path: Path, dynamic, static):
        fun, filtered = self.fun, self.filter

        @functools.wraps(fun)
        def traced(dynamic):
            args, kwargs = eqx.combine(dynamic, static) if filtered else dynamic
            return fun(*args, **kwargs)

        lowered = jax.jit(traced, compiler_options=self.options).trace(dynamic).lower()
        with _fresh_compilation():
            compiled = lowered.compile()
        try:
            serialized, _, out_tree = serialize_executable.serialize(compiled)
            out_skeleton = jax.tree.unflatten(out_tree, [0] * out_tree.num_leaves)
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(_FORMAT)
                    pickle.dump((serialized, out_skeleton), fh, protocol=5)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            _prune(path.parent, self.fun.__name__)
        except Exception:  # an unwritable directory, an executable that cannot be serialized
            pass
        return compiled


def _prune(directory: Path, name: str) -> None:
    """Delete all but the `KEEP` newest programs of function `name` (each change to the
    package's sources stores a new one)."""
    programs = sorted(directory.glob(f"{name}-*.program"), key=lambda p: p.stat().st_mtime)
    for old in programs[:-KEEP]:
        old.unlink(missing_ok=True)


def stored_jit(fun=None, *, compiler_options: dict | None = None, filter: bool = False):
    """`jax.jit(fun)` (`filter=True`: `equinox.filter_jit(fun)`) whose compiled programs are
    also stored in the directory of `set_directory` (when one is set) and loaded from there by
    later processes. As a decorator with or without arguments."""
    if fun is None:
        return functools.partial(stored_jit, compiler_options=compiler_options, filter=filter)
    return _StoredJit(fun, compiler_options, filter)
