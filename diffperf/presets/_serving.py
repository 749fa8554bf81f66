"""Serving presets: scheduler settings of named engines (`engines.json`) and the price and
power of each GPU preset (`deployment.json`), every value with its source."""

from __future__ import annotations

from ..specs._engine import ENGINE_FIELDS, Engine
from . import _files


def _entry(kind: str, name, what: str) -> dict:
    """The entry `name` (any case) of shipped table `kind`; a one-line ValueError naming it
    and the known ids otherwise."""
    table = _files.table(kind)
    key = str(name).strip().lower()
    if key not in table:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}")
    return table[key]


def engine_names() -> list[str]:
    """Ids of the shipped serving-engine presets (`vllm`, `sglang`, `trtllm`, ...)."""
    return sorted(_files.table("engines"))


def engine(name: str) -> Engine:
    """The `Engine` (scheduler settings) of an engine preset, e.g. `engine("vllm")`: request
    slots (count), token budget per iteration (tokens), chunked prefill (0/1), policy,
    KV-cache block (tokens) and KV share of the free HBM (0-1). Case-insensitive; an unknown
    name raises a ValueError listing the known ones."""
    row = _entry("engines", name, "engine")
    return Engine(**{f: row[f] for f in ENGINE_FIELDS if f in row})  # other keys: text


def engine_info(name: str) -> dict:
    """The preset's JSON record: the `Engine` fields, `description`, `source` (where each value
    comes from) and `native` (the engine's own memory setting before conversion)."""
    return dict(_entry("engines", name, "engine"))


def _deployment(gpu_id: str) -> dict:
    return _entry("deployment", gpu_id, "gpu")


def gpu_price_per_hour(gpu_id: str) -> float:
    """On-demand cloud price of one GPU of preset `gpu_id` (a gpus.json id), USD per
    GPU-hour (deployment.json says which provider and list)."""
    return float(_deployment(gpu_id)["price_per_hour"])


def gpu_power(gpu_id: str) -> tuple[float, float]:
    """(idle, tdp) power of one GPU of preset `gpu_id`, W: idle is the draw with a model
    loaded and no work, tdp the datasheet maximum board power."""
    row = _deployment(gpu_id)
    return float(row["power_idle"]), float(row["power_tdp"])
