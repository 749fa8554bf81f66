"""Up-front checks of command-line values and paths, so a bad value fails at once with a
one-line error naming the option, never after minutes of work or with a traceback."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

from .._checks import MAX_EXACT_COUNT
from ..design._technology import tables
from ..presets import (
    chip_of,
    gpu_names,
    is_spec_file,
    resolve_hardware_name,
    runtime,
    runtime_names,
)


class CliError(Exception):
    """A user error: printed as `error: ...` with exit code 2, never a traceback."""


#: Options that count things: whole numbers >= 1 wherever a command has them.
_AT_LEAST_ONE = ("gpus", "nvlink_domain", "tp", "pp", "dp", "cp", "ep", "vp", "micro_batch",
                 "global_batch", "seq_len", "n", "batch", "input", "output", "max_gpus",
                 "starts", "repeats")
#: Of those, the sizes the model computes with in float32 (all but the sweep size `n`, the
#: optimiser's `starts` and `bench cli`'s `repeats`), which counts integers exactly only up to
#: 2^24 (a larger GPU count or length would be silently rounded).
_FLOAT32_EXACT = tuple(k for k in _AT_LEAST_ONE if k not in ("n", "starts", "repeats"))
#: Options that are physical budgets or targets: > 0.
_POSITIVE = ("latency", "tpot", "area", "power", "perimeter", "cost")
#: Options where 0 is meaningful (no L-BFGS stage, no prior, expert TP = TP, no prefill cap,
#: no layer recomputed in full / offloaded).
_NON_NEGATIVE = ("lbfgs_steps", "prior_weight", "expert_tp", "prefill_tokens",
                 "recompute_layers", "offload_layers")
#: Counts where 0 is meaningful that the model also computes with in float32.
_FLOAT32_EXACT_OR_ZERO = ("expert_tp", "prefill_tokens", "recompute_layers", "offload_layers")
#: Sizes of the work a command does, capped where the work would otherwise run for hours or
#: exhaust memory ((command, option) -> largest value): the optimiser's steps and vmapped
#: starts of `codesign` (also `CODESIGN_MAX_EVALUATIONS` for steps x starts), the fit's
#: steps of `calibrate`, the sweep size of `bench`.
WORK_CAPS = {("codesign", "steps"): 100_000, ("codesign", "starts"): 4096,
             ("calibrate", "steps"): 100_000, ("calibrate", "lbfgs_steps"): 100_000,
             ("bench", "n"): 10_000_000, ("bench", "repeats"): 1000}
#: Largest `codesign` --steps x --starts: about a minute and 1 GB on a 2-core CPU.
CODESIGN_MAX_EVALUATIONS = 10_000_000
#: Shares in (0, 1]: the fraction of the tensor peak a GEMM kernel can reach.
_FRACTIONS = ("gemm_peak_fraction",)


def _values(v) -> list:
    """An option's values: [] for None, the list of a repeatable option, else [v]."""
    return [] if v is None else v if isinstance(v, list) else [v]


def _opt(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_values(args) -> None:
    """Raise CliError naming the first option whose value is out of its range."""
    get = lambda k: getattr(args, k, None)  # noqa: E731
    for k, v in sorted(vars(args).items()):
        for x in (v if isinstance(v, list) else [v]):
            if isinstance(x, float) and not math.isfinite(x):
                raise CliError(f"{_opt(k)} must be a finite number, got {x}")
    for k in _AT_LEAST_ONE:
        if get(k) is not None and get(k) < 1:
            raise CliError(f"{_opt(k)} must be >= 1, got {get(k)}")
    command = get("command")
    for (cmd, k), cap in WORK_CAPS.items():
        if command == cmd and get(k) is not None and get(k) > cap:
            raise CliError(f"{_opt(k)} must be <= {cap:,} (the most `diffperf {cmd}` "
                           f"accepts), got {get(k):,}")
    if command == "codesign" and get("steps") * get("starts") > CODESIGN_MAX_EVALUATIONS:
        raise CliError(f"--steps x --starts must be <= {CODESIGN_MAX_EVALUATIONS:,} "
                       f"(about a minute and 1 GB), got {get('steps')} x {get('starts')} = "
                       f"{get('steps') * get('starts'):,}")
    for k in (*_FLOAT32_EXACT, *_FLOAT32_EXACT_OR_ZERO):
        for x in _values(get(k)):
            if x > MAX_EXACT_COUNT:
                raise CliError(f"{_opt(k)} must be <= {MAX_EXACT_COUNT} (2^24: larger counts "
                               f"are not exact in float32), got {x}")
    for k, v in sorted(vars(args).items()):  # every other whole number: 2^24 is beyond use
        for x in _values(v):
            if type(x) is int and x > MAX_EXACT_COUNT:
                raise CliError(f"{_opt(k)} must be <= {MAX_EXACT_COUNT} (2^24), got {x}")
    for k in _POSITIVE:
        if get(k) is not None and not get(k) > 0:
            raise CliError(f"{_opt(k)} must be > 0, got {get(k)}")
    for k in _NON_NEGATIVE:
        for x in _values(get(k)):
            if x < 0:
                raise CliError(f"{_opt(k)} must be >= 0, got {x}")
    for k in _FRACTIONS:
        if get(k) is not None and not 0 < get(k) <= 1:
            raise CliError(f"{_opt(k)} must lie in (0, 1], got {get(k):g}")
    if get("top") is not None:
        # `sensitivity --top 0` (its default) means every row; elsewhere top counts plans.
        low = 0 if command == "sensitivity" else 1
        if get("top") < low:
            raise CliError(f"--top must be >= {low}, got {get('top')}")
    if get("steps") is not None:
        low = 1 if command == "codesign" else 0
        if get("steps") < low:
            raise CliError(f"--steps must be >= {low}, got {get('steps')}")
    if command == "calibrate" and get("folds") is not None and get("folds") < 2:
        raise CliError(f"--folds must be >= 2 for k-fold cross-validation, got {get('folds')}")
    _check_technology_ranges(args)


def _check_technology_ranges(args) -> None:
    """Logic nodes and memory / network generations must lie inside the technology tables
    (outside them the tables would be silently clamped to their end rows)."""
    nodes = getattr(args, "nodes", None) or []
    node = getattr(args, "node", None)
    mem, net = getattr(args, "memory_gen", None), getattr(args, "network_gen", None)
    if not nodes and node is None and mem is None and net is None:
        return
    t = tables()
    known = [float(r["node_nm"]) for r in t["logic"]["rows"]]
    lo, hi = min(known), max(known)
    for name, values in (("--nodes", nodes), ("--node", [] if node is None else [node])):
        for v in values:
            if not lo <= v <= hi:
                raise CliError(f"{name} must lie in [{lo:g}, {hi:g}] nm (the technology "
                               f"tables), got {v:g}")
    for name, v, table in (("--memory-gen", mem, "memory"), ("--network-gen", net, "network")):
        top = len(t[table]["rows"]) - 1
        if v is not None and not 0 <= v <= top:
            raise CliError(f"{name} must lie in [0, {top}], got {v:g}")


#: Options naming GPU or system presets (`targets` is a list).
_HARDWARE = ("gpu", "system", "base", "targets")


def resolve_hardware_names(args) -> None:
    """Replace each GPU / system option's value by the preset id it stands for (`--gpu h100`
    -> `h100-sxm5-80gb`), so every later lookup, the per-GPU calibration included, sees the
    full id; raise CliError naming the option for an unknown or ambiguous name. A GPU or
    system JSON file (docs/spec-files.md) is validated and stays its path, the name every
    later lookup takes; a note says when its GPU names no `efficiency_of` preset (the shared
    efficiency factors then apply). `--runtime` is checked the same way (a preset id or a
    runtime file)."""
    for dest in _HARDWARE:
        value = getattr(args, dest, None)
        if value is None:
            continue
        try:
            if isinstance(value, list):
                setattr(args, dest, [resolve_hardware_name(v) for v in value])
            else:
                setattr(args, dest, resolve_hardware_name(value))
        except ValueError as e:
            raise CliError(f"{_opt(dest)}: {e}") from None
    for dest in ("gpu", "system"):
        value = getattr(args, dest, None)
        if dest == "system" and getattr(args, "gpu", None) is not None:
            continue  # --gpu's accelerator replaces the system's
        if isinstance(value, str) and is_spec_file(value) and chip_of(value) not in gpu_names():
            print(f"note: {_opt(dest)} {value}: its GPU names no \"efficiency_of\" preset GPU, "
                  f"so the shared efficiency factors apply, not a preset GPU's fitted ones (add "
                  f"e.g. \"efficiency_of\": \"h100-sxm5-80gb\" for a GPU with that chip)",
                  file=sys.stderr)
    name = getattr(args, "runtime", None)
    if isinstance(name, str):
        try:
            runtime(name)
        except ValueError as e:
            raise CliError(f"--runtime: {e}") from None
        if name.lower() in runtime_names():
            args.runtime = name.lower()


#: Options naming files the command reads / writes.
_INPUTS = ("efficiency", "data")
_OUTPUTS = ("out", "plot", "csv", "all_plans")


def check_paths(args) -> None:
    """Inputs must be existing files; outputs must go to an existing directory (checked before
    any work is done)."""
    for k in _INPUTS:
        values = getattr(args, k, None)
        values = [values] if isinstance(values, str) else values or []
        seen = set()
        for v in values:
            key = Path(v).resolve()
            if key in seen:
                raise CliError(f"{_opt(k)}: {v} is given twice (its rows would count twice)")
            seen.add(key)
        for v in values:
            p = Path(v)
            if not p.exists():
                raise CliError(f"{_opt(k)}: no such file: {v}")
            if not p.is_file():
                raise CliError(f"{_opt(k)}: not a file: {v}")
    for k in _OUTPUTS:
        v = getattr(args, k, None)
        if not isinstance(v, str):
            continue
        if not v.strip():
            raise CliError(f"{_opt(k)}: expected a file name, got an empty string")
        p = Path(v)
        if p.is_dir():
            raise CliError(f"{_opt(k)}: is a directory, expected a file name: {v}")
        if not p.resolve().parent.is_dir():
            raise CliError(f"{_opt(k)}: directory does not exist: {p.parent}")
        if not os.access(p.resolve().parent, os.W_OK):
            raise CliError(f"{_opt(k)}: directory is not writable: {p.parent}")
        _check_format(args, k, p)
        check_writable(_opt(k), p)


def check_writable(option: str, path: Path | str) -> None:
    """Open `path` for writing without changing it (an existing file is opened for appending
    and closed; a new one is created and removed), so that an output that cannot be written
    fails before the work, not after it (`os.access` says yes to root on a read-only file
    system)."""
    p = Path(path)
    existed = p.exists()
    try:
        with p.open("a"):
            pass
    except OSError as e:
        raise CliError(f"{option}: cannot write {path}: {e.strerror or e}") from None
    if not existed:
        p.unlink(missing_ok=True)


def _check_format(args, option: str, path: Path) -> None:
    """The output format must be one the command can write (checked before the work)."""
    suffix = path.suffix.lower().lstrip(".")
    if option == "plot":
        try:
            from matplotlib.figure import Figure
        except ImportError:
            raise CliError("--plot needs matplotlib: pip install matplotlib") from None
        formats = sorted(Figure().canvas.get_supported_filetypes())
        if suffix not in formats:
            raise CliError(f"--plot: unsupported image format {path.suffix or '(none)'!r} of "
                           f"{path}; use one of {', '.join('.' + f for f in formats)}")
    elif option == "out" and getattr(args, "command", None) == "predict":
        if suffix != "csv":
            raise CliError(f"--out: use a .csv file name, got {path}")
    elif option == "out" and getattr(args, "command", None) == "search":
        if suffix not in ("csv", "parquet"):
            raise CliError(f"--out: use a .csv or .parquet file name, got {path}")
        if suffix == "parquet" and importlib.util.find_spec("pyarrow") is None:
            raise CliError("--out: writing parquet needs pyarrow: pip install pyarrow "
                           "(or use .csv)")
