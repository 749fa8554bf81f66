"""Named GPUs, systems, models and efficiency sets shipped with the package (JSON with sources)."""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

from ..efficiency import Efficiency
from ..hardware import Accelerator, Network, System
from ..model import Transformer

_ACCEL_FIELDS = ("flops_fp32", "flops_bf16", "flops_fp8", "flops_fp4", "vector_flops",
                 "hbm_capacity", "hbm_bandwidth", "l2_capacity", "l2_bandwidth", "num_sms",
                 "launch_overhead")
_NET_FIELDS = ("nvlink_domain", "nvlink_bandwidth", "nvlink_latency", "scaleout_bandwidth",
               "scaleout_latency")
_MODEL_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len",
                 "gated_mlp", "num_experts", "experts_per_token")


@functools.cache
def _table(name: str) -> dict:
    text = resources.files("diffperf.presets").joinpath(f"{name}.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def _lookup(kind: str, name: str) -> dict:
    table = _table(kind)
    key = str(name).lower()
    if key not in table:
        raise ValueError(f"unknown {kind[:-1]} {name!r}; known: {', '.join(sorted(table))}")
    return table[key]


def gpu_names() -> list[str]:
    """Ids of the shipped GPU presets."""
    return sorted(_table("gpus"))


def system_names() -> list[str]:
    """Ids of the shipped system presets."""
    return sorted(_table("systems"))


def model_names() -> list[str]:
    """Ids of the shipped model presets."""
    return sorted(_table("models"))


def gpu(name: str) -> Accelerator:
    """The `Accelerator` of a GPU preset, e.g. `gpu("h100-sxm5-80gb")`."""
    row = _lookup("gpus", name)
    return Accelerator(**{f: row[f] for f in _ACCEL_FIELDS})


def gpu_info(name: str) -> dict:
    """The raw preset entry (with `name`, `sources`, default `system`)."""
    return dict(_lookup("gpus", name))


def system(name: str, nvlink_domain: int | None = None) -> System:
    """A `System` by system id (`dgx-h100`) or GPU id (`h100-sxm5-80gb`: its default system).

    `nvlink_domain` overrides the NVLink domain size (e.g. 8 GPUs per node)."""
    key = str(name).lower()
    if key in _table("gpus") and key not in _table("systems"):
        key = _table("gpus")[key]["system"]
    row = dict(_lookup("systems", key))
    if nvlink_domain is not None:
        row["nvlink_domain"] = nvlink_domain
    return System(gpu(row["gpu"]), Network(**{f: row[f] for f in _NET_FIELDS}))


def model(name: str) -> Transformer:
    """A `Transformer` preset, e.g. `model("gpt3-175b")` or `model("llama3-70b")`."""
    row = _lookup("models", name)
    return Transformer(**{f: row[f] for f in _MODEL_FIELDS if f in row})


def efficiency_from_json(path: str | Path) -> Efficiency:
    """Load an `Efficiency` from a JSON file with a `factors` object (or a flat object)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"efficiency file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"efficiency file {path} is not valid JSON: {e}") from None
    factors = data.get("factors", data)
    known = set(Efficiency.__dataclass_fields__)
    unknown = sorted(set(factors) - known)
    if unknown:
        raise ValueError(f"efficiency file {path}: unknown factors {unknown}; known: "
                         f"{sorted(known)}")
    return Efficiency(**factors)


@functools.cache
def _default_efficiency_values() -> dict:
    ref = resources.files("diffperf.presets").joinpath("efficiency.json")
    if ref.is_file():
        return json.loads(ref.read_text()).get("factors", {})
    return {}


def default_efficiency() -> Efficiency:
    """The efficiency factors the library uses by default (the shipped calibration, if any;
    otherwise the physical defaults of `Efficiency()`)."""
    return Efficiency(**_default_efficiency_values())
