"""Where the command line caches compiled programs (standard library only: the daemon's client,
`_daemon_client`, puts it in its fingerprint without importing JAX)."""

from __future__ import annotations

import os
from pathlib import Path

#: Values of `DIFFPERF_COMPILATION_CACHE` that turn the cache off.
OFF = ("0", "off", "false", "no", "")


def cache_directory() -> Path | None:
    """The directory the command line caches compiled programs in, or None when turned off."""
    setting = os.environ.get("DIFFPERF_COMPILATION_CACHE")
    if setting is not None and setting.strip().lower() in OFF:
        return None
    if setting:
        return Path(setting).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "diffperf" / "jax"
