"""On-disk cache of compiled XLA programs for the command line, so that only the first
`diffperf train` / `infer` / `search` / `validate` run pays the compilation (seconds on a
2-core CPU: measured cold -> warm, `diffperf train` 5.7-6.1 -> 3.0-3.2 s, `infer` 4.0-4.3 ->
2.7-2.9 s, `validate --summary` 10.3-11.4 -> 4.8-5.9 s, the GPT-3 175B / 1,024 GPU
`search train` 9.9-11.2 -> 5.1-5.7 s).

The programs of `stored_jit` functions (the training step, the batched CSV rows) are also
stored, with their arguments' structure, in its `programs` subdirectory
(`diffperf._stored_programs`): a later run skips tracing them as well.

Used by `diffperf.cli.main` (not on import: a library should not change JAX's configuration).
The directory is `$DIFFPERF_COMPILATION_CACHE` if that is a path, else
`$XDG_CACHE_HOME/diffperf/jax` (default `~/.cache/diffperf/jax`), created private to the user:
JAX trusts its cache, so it must not be writable by others. `DIFFPERF_COMPILATION_CACHE=0`
turns it off; a directory already chosen through JAX's own `JAX_COMPILATION_CACHE_DIR` is
left as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from .._stored_programs import set_directory
from ._cache_path import cache_directory

#: Subdirectory of the programs stored with their arguments' structure (`diffperf._stored_programs`:
#: a later run skips tracing them too).
PROGRAMS = "programs"
#: Programs that compile faster than this are not written, s. 0: the many small programs add
#: up (at 0.5 s `infer` and `train --interval` gained nothing); a full cache is about 1 MB.
MIN_COMPILE_SECONDS = 0.0


def enable_compilation_cache() -> Path | None:
    """Point JAX's persistent compilation cache at `cache_directory()` (made private to the
    user); return it, or None if the cache is off, already configured through JAX, or the
    directory cannot be created (then everything still works, uncached)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return None
    path = cache_directory()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        if path.stat().st_mode & 0o022:  # writable by group or others: do not trust it
            return None
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    set_directory(path / PROGRAMS)
    return path


def disable_compilation_cache() -> None:
    """No persistent cache in this process, even one set through `JAX_COMPILATION_CACHE_DIR`
    (`diffperf bench` measures cold, compilation-included times)."""
    jax.config.update("jax_enable_compilation_cache", False)
    set_directory(None)
