"""Named GPUs, systems, models and efficiency sets shipped with the package (JSON with sources)."""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources
from pathlib import Path

import equinox as eqx
import jax

from .._checks import read_json
from ..specs._efficiency import Efficiency
from ..specs._hardware import Accelerator, Network, System
from ..specs._runtime import Runtime
from ..specs._transformer import Transformer
from . import _files
from ._serving import (
    engine as engine,
    engine_info as engine_info,
    engine_names as engine_names,
    gpu_power as gpu_power,
    gpu_price_per_hour as gpu_price_per_hour,
)

_ACCEL_FIELDS = ("flops_fp32", "flops_bf16", "flops_fp8", "flops_fp4", "vector_flops",
                 "hbm_capacity", "hbm_bandwidth", "l2_capacity", "l2_bandwidth", "num_sms",
                 "launch_overhead", "host_bandwidth", "host_memory",
                 "host_memory_bandwidth", "host_time_factor", "sfu_ratio")
_NET_FIELDS = ("nvlink_domain", "nvlink_bandwidth", "nvlink_latency", "scaleout_bandwidth",
               "scaleout_latency", "nvlink_sharp")
_MODEL_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len",
                 "gated_mlp", "num_experts", "experts_per_token", "parallel_attention",
                 "dropout", "tied_embeddings", "head_width", "sliding_window", "global_layers",
                 "dense_layers", "dense_ffn_hidden", "shared_ffn_hidden", "kv_lora_rank",
                 "q_lora_rank", "rope_head_dim", "v_head_dim", "expert_bias", "glu_clamp")


_table = _files.table  # the shipped tables, id -> entry


def _lookup(kind: str, name: str) -> dict:
    table = _table(kind)
    key = str(name).lower()
    if key not in table:
        if _files.is_file_name(name):  # a spec file stands for itself (presets/_files.py)
            return _files.row(kind, str(name))
        raise ValueError(f"unknown {kind[:-1]} {name!r}; known: {', '.join(sorted(table))}")
    return table[key]


def gpu_names() -> list[str]:
    """Ids of the shipped GPU presets."""
    return sorted(_table("gpus"))


def system_names() -> list[str]:
    """Ids of the shipped system presets."""
    return sorted(_table("systems"))


def system_gpu(name: str) -> str:
    """The GPU id of a system preset (`gb200-nvl72` -> `gb200`); a GPU id is returned as is.
    A system file gives its GPU's name (a GPU id, a GPU file, or the system file itself for a
    nested GPU object); a GPU file is returned as is."""
    key = str(name).lower()
    if key in _table("systems"):
        return _table("systems")[key]["gpu"]
    if key not in _table("gpus") and _files.is_file_name(name):
        return _files.hardware(name).gpu_name
    return key


def _gpu_entry(name: str) -> dict:
    """The gpus.json entry of a GPU id, or a file's GPU; {} for other names."""
    key = str(name).lower()
    if key in _table("gpus"):
        return _table("gpus")[key]
    return _files.hardware(name).gpu if _files.is_file_name(name) else {}


def model_names() -> list[str]:
    """Ids of the shipped model presets."""
    return sorted(_table("models"))


def resolve_hardware_name(name: str) -> str:
    """The preset id a GPU or system name stands for: the id itself (any case), else the one
    GPU id, or failing that the one system id, that starts with `name` + "-" (`h100` ->
    `h100-sxm5-80gb`, `nvl72` is not a prefix and stays unknown). Raises a ValueError listing
    the candidates when the prefix is ambiguous (`a100`: the 40 GB and the 80 GB part) or
    the known ids when nothing matches. A GPU or system file (a name ending in `.json`, or an
    existing file) is validated and stands for itself: its path is returned as given."""
    key = str(name).strip().lower()
    gpus, systems = gpu_names(), system_names()
    if key in gpus or key in systems:
        return key
    if _files.is_file_name(name):  # a GPU or system file: validated, named by its path
        _files.hardware(name)
        return str(name)
    for ids in (gpus, systems):
        hits = [i for i in ids if i.startswith(key + "-")]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise ValueError(f"ambiguous gpu or system {name!r}: {', '.join(hits)}")
    raise ValueError(f"unknown gpu or system {name!r}; known GPUs: {', '.join(gpus)}; "
                     f"systems: {', '.join(systems)}")


def gpu(name: str) -> Accelerator:
    """The `Accelerator` of a GPU preset, e.g. `gpu("h100-sxm5-80gb")`."""
    row = _lookup("gpus", name)
    return Accelerator(**{f: row[f] for f in _ACCEL_FIELDS if f in row})


def gpu_info(name: str) -> dict:
    """The raw preset entry (with `name`, `sources`, default `system`)."""
    return dict(_lookup("gpus", name))


def _unsupported_precisions(gpu_or_system: str) -> dict[str, str]:
    """{precision name: why} for the preset's GPU (`unsupported_precisions` in gpus.json: names
    the precision codes cannot tell apart from supported ones); {} for other names."""
    return _gpu_entry(system_gpu(gpu_or_system)).get("unsupported_precisions", {})


def check_precision_names(gpu_or_system: str, **names: str | None) -> None:
    """Raise a ValueError naming the option if the preset's GPU lacks a precision that the
    precision codes cannot tell apart from a supported one (V100: bf16 shares fp16's code, tf32
    fp32's). `names` maps an option name to a precision name (None = not given)."""
    missing = _unsupported_precisions(gpu_or_system)
    for option, name in names.items():
        if name is not None and str(name).lower() in missing:
            raise ValueError(f"{option} {name}: {missing[str(name).lower()]}")


def default_precision(gpu_or_system: str) -> str:
    """The 16-bit precision the command line defaults to on the preset's GPU: bf16, or fp16
    where the GPU has no bf16 (V100)."""
    return "fp16" if "bf16" in _unsupported_precisions(gpu_or_system) else "bf16"


def precision_label(gpu_or_system: str, name: str) -> str:
    """The name to print for precision `name` on the preset's GPU: 'fp16' for the 16-bit code
    on a GPU without bf16 (V100), else `name`."""
    return "fp16" if name == "bf16" and "bf16" in _unsupported_precisions(gpu_or_system) else name


def system(name: str, nvlink_domain: int | None = None) -> System:
    """A `System` by system id (`dgx-h100`) or GPU id (`h100-sxm5-80gb`: that GPU in its
    default system's network; `a100-sxm4-40gb` keeps its 40 GB although DGX A100 is listed with
    the 80 GB part).

    `nvlink_domain` overrides the NVLink domain size (e.g. 8 GPUs per node)."""
    key = str(name).lower()
    accelerator = None
    if key in _table("gpus") and key not in _table("systems"):
        accelerator = gpu(key)
        key = _table("gpus")[key]["system"]
    elif key not in _table("systems"):
        if not _files.is_file_name(name):
            raise ValueError(f"unknown gpu or system {name!r}; known GPUs: "
                             f"{', '.join(gpu_names())}; systems: {', '.join(system_names())}")
        key = str(name)  # a system file, or a GPU file in the network of its `system`
        if _files.hardware(key).system is None:
            accelerator = gpu(key)
            key = _files.gpu_system(key)
    row = dict(_lookup("systems", key))
    if nvlink_domain is not None:
        row["nvlink_domain"] = nvlink_domain
    return System(accelerator or gpu(row["gpu"]),
                  Network(**{f: row[f] for f in _NET_FIELDS if f in row}))


#: The runtime of the calibration set, used when nothing names one.
DEFAULT_RUNTIME = "megatron-core"
_RUNTIME_FIELDS = tuple(f.name for f in dataclasses.fields(Runtime))


def runtime_names() -> list[str]:
    """Ids of the shipped software-runtime presets."""
    return sorted(_table("runtimes"))


def runtime(name: str | None = None) -> Runtime:
    """A `Runtime` preset by id (`megatron-deepspeed-2023`); None: `DEFAULT_RUNTIME`."""
    row = _lookup("runtimes", DEFAULT_RUNTIME if name is None else name)
    return Runtime(**{f: row[f] for f in _RUNTIME_FIELDS if f in row})


def runtime_plan_defaults(name: str | None = None) -> dict[str, float]:
    """The plan options the runtime's software fixes (`TrainingPlan` field -> value), for
    plans that leave them unset; explicit values win. None: `DEFAULT_RUNTIME`'s (none)."""
    row = _lookup("runtimes", DEFAULT_RUNTIME if name is None else name)
    return {k: float(v) for k, v in row.get("plan_defaults", {}).items()}


def runtime_info(name: str) -> dict:
    """The preset's JSON record (fields, `description`, `source`)."""
    return dict(_lookup("runtimes", name))


def model(name: str, max_context: bool = False) -> Transformer:
    """A `Transformer` preset, e.g. `model("gpt3-175b")` or `model("llama3-70b")`. Its `seq_len`
    is the pre-training sequence length; with `max_context`, the longest context the model
    serves where the preset records one (`max_context`, its config's max_position_embeddings),
    as `diffperf.transformer_from_hf_config(..., max_context=True)` does for a config file."""
    row = _lookup("models", name)
    fields = {f: row[f] for f in _MODEL_FIELDS if f in row}
    if max_context and "max_context" in row:
        fields["seq_len"] = row["max_context"]
    return Transformer(**fields)


# Spec files: every function above that takes a preset id also takes the path of a JSON file
# in the format of that preset table (presets/_files.py, docs/spec-files.md), which then
# stands for itself: `gpu("my_gpu.json")`, `chip_of("my_gpu.json")` (its `efficiency_of`).
def is_spec_file(name) -> bool:
    """Whether a GPU / system / model / runtime name is a spec file's path (it ends in `.json`
    or is an existing file) rather than a preset id (look ids up first)."""
    return _files.is_file_name(name)


def _as_file(path) -> str:
    if not _files.is_file_name(path):
        raise ValueError(f"{path}: no such file (a spec file's name ends in .json)")
    return str(path)


def gpu_from_file(path: str | Path) -> Accelerator:
    """The `Accelerator` of a GPU file (or of a system file's GPU): the fields of a gpus.json
    entry. Raises a ValueError naming the file and the field."""
    return gpu(_as_file(path))


def system_from_file(path: str | Path, nvlink_domain: int | None = None) -> System:
    """The `System` of a system file (network fields and `gpu`: a GPU id, a GPU file or a GPU
    object), or of a GPU file in the network of the preset `system` it names."""
    return system(_as_file(path), nvlink_domain)


def model_from_file(path: str | Path, max_context: bool = False) -> Transformer:
    """The `Transformer` of a model file: the fields of a models.json entry (not a Hugging Face
    config.json: `diffperf.transformer_from_hf_config` reads those)."""
    return model(_as_file(path), max_context)


def runtime_from_file(path: str | Path) -> Runtime:
    """The `Runtime` of a runtime file: the fields of a runtimes.json entry (its
    `plan_defaults`: `runtime_plan_defaults(path)`)."""
    return runtime(_as_file(path))


def is_model_file(path: str | Path) -> bool:
    """Whether `path` is a diffperf model file rather than a Hugging Face config.json (its
    fields are `layers`, `hidden`, ...; a config's are `model_type`, `hidden_size`, ...).
    Raises a ValueError for a file that is not JSON."""
    return _files.is_model_file(read_json(path, "model file or Hugging Face config"))


def preset_file(name: str) -> dict:
    """Preset `name` (a GPU, system, model or runtime id) as the JSON object of a spec file,
    which the loaders read back to the same predictions: a GPU names its `efficiency_of`
    (whose fitted factors it uses), a system holds its GPU as a nested object
    (`diffperf presets export NAME`; a GPU or system prefix such as `h100` names one too)."""
    key = str(name).strip().lower()
    known = [i for kind in ("gpus", "systems", "models", "runtimes") for i in _table(kind)]
    if key not in known:
        try:
            key = resolve_hardware_name(key)
        except ValueError:
            pass
    if key not in known:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(known)}")
    return _files.export(key)


class GpuEfficiency(Efficiency):
    """An `Efficiency` (the shared factors, usable anywhere an `Efficiency` is) that also carries
    per-GPU-generation overrides, as written by `diffperf calibrate` (`"per_gpu"` in the JSON).

    `for_gpu(name)` returns the shared factors merged with that GPU's overrides (a plain
    `Efficiency`); GPUs without overrides get the shared factors. `diffperf validate` uses the
    factors of each row's GPU when given a `GpuEfficiency`.
    """

    #: ((gpu id, ((field, value), ...)), ...): hashable, so it is static under jit.
    per_gpu: tuple = eqx.field(static=True, default=())

    def overrides(self, gpu: str | None) -> dict:
        """The factors overridden for GPU `gpu` (empty for None or a GPU without overrides). A
        preset GPU without its own takes those of the GPU named by its `efficiency_of` entry
        (the H800 is an H100 with less NVLink: same chip, same kernels)."""
        if gpu is None:
            return {}
        table = dict(self.per_gpu)
        key = fitted_gpu(gpu, table)
        return dict(table[key]) if key is not None else {}

    def shared(self) -> Efficiency:
        """The shared factors as a plain `Efficiency`."""
        return Efficiency(**{f: getattr(self, f) for f in Efficiency.__dataclass_fields__})

    def for_gpu(self, gpu: str | None) -> Efficiency:
        """Shared factors merged with the overrides of `gpu` (None: the shared factors)."""
        values = {f: getattr(self, f) for f in Efficiency.__dataclass_fields__}
        values.update(self.overrides(gpu))
        return Efficiency(**values)

    @property
    def gpus(self) -> list[str]:
        """GPU ids that have overrides."""
        return [g for g, _ in self.per_gpu]


def chip_of(gpu: str) -> str:
    """The GPU whose chip and kernels `gpu` has: itself (a system id stands for its GPU), or
    the GPU its preset names as `efficiency_of` (the H800 is an H100 with less NVLink)."""
    key = system_gpu(gpu)
    return _gpu_entry(key).get("efficiency_of", key)


def fitted_gpu(gpu: str, fitted) -> str | None:
    """The GPU among `fitted` (ids with their own fitted factors) whose factors apply to `gpu`:
    itself (a system id stands for its GPU), else its `chip_of`; None when neither was
    fitted."""
    key = system_gpu(gpu)
    if key not in fitted:
        key = chip_of(key)
    return key if key in fitted else None


def resolve_efficiency(efficiency: Efficiency | None, gpu: str | None = None) -> Efficiency:
    """The one rule for which efficiency factors apply: `efficiency` when given (its entry for
    `gpu` if it is a `GpuEfficiency` and a GPU is named), else the shipped default
    (`default_efficiency(gpu)`: the shared factors carrying the per-GPU ones when `gpu` is
    None). Every entry point that takes `efficiency=None` resolves it here."""
    if efficiency is None:
        return default_efficiency(gpu)
    if gpu is not None and isinstance(efficiency, GpuEfficiency):
        return efficiency.for_gpu(gpu)
    return efficiency


def _check_factors(path, factors: dict, where: str) -> dict:
    if not isinstance(factors, dict):
        raise ValueError(f"efficiency file {path}: {where} must be a JSON object")
    known = set(Efficiency.__dataclass_fields__)
    unknown = sorted(set(factors) - known)
    if unknown:
        raise ValueError(f"efficiency file {path}: unknown factors {unknown} in {where}; known: "
                         f"{sorted(known)}")
    for k, v in factors.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ValueError(f"efficiency file {path}: {where}.{k} must be a number, got {v!r}")
    return factors


def _gpu_efficiency(data: dict, path) -> GpuEfficiency:
    factors = _check_factors(path, data.get("factors", {}), "factors")
    per_gpu = data.get("per_gpu", {}) or {}
    if not isinstance(per_gpu, dict):
        raise ValueError(f"efficiency file {path}: per_gpu must be a JSON object")
    known_gpus = set(_table("gpus"))
    entries = []
    for g in sorted(per_gpu):
        if g.lower() not in known_gpus:
            raise ValueError(f"efficiency file {path}: per_gpu has unknown gpu {g!r}; known: "
                             f"{', '.join(sorted(known_gpus))}")
        over = _check_factors(path, per_gpu[g], f"per_gpu.{g}")
        try:
            Efficiency(**{**factors, **over})  # validates the merged factors (ranges)
        except ValueError as e:
            raise ValueError(f"efficiency file {path}, per_gpu.{g}: {e}") from None
        entries.append((g.lower(), tuple(sorted((k, float(v)) for k, v in over.items()))))
    try:
        return GpuEfficiency(**factors, per_gpu=tuple(entries))
    except ValueError as e:
        raise ValueError(f"efficiency file {path}: {e}") from None


def efficiency_from_json(path: str | Path) -> GpuEfficiency:
    """Load efficiency factors from a JSON file: `{"factors": {...}, "per_gpu": {gpu: {...}}}`
    (as written by `diffperf calibrate`) or a flat `{factor: value}` object.

    **Returns:** a `GpuEfficiency`: usable as a plain `Efficiency` (the shared factors);
    `.for_gpu(name)` gives a GPU's factors (used per row by `diffperf validate`).
    """
    path = Path(path)
    data = read_json(path, "efficiency file")
    if not isinstance(data, dict):
        raise ValueError(f"efficiency file {path}: expected a JSON object")
    if "factors" not in data and "per_gpu" not in data:
        data = {"factors": data}
    if not data.get("factors") and not data.get("per_gpu"):
        raise ValueError(f"efficiency file {path} sets no factors (omit the file for the shipped "
                         f"calibration; factors it does not set take the physical defaults)")
    return _gpu_efficiency(data, path)


@functools.cache
def _default_efficiency_data() -> dict:
    ref = resources.files("diffperf.presets").joinpath("efficiency.json")
    if ref.is_file():
        return json.loads(ref.read_text())
    return {}


def _default_gpu_efficiency() -> GpuEfficiency:
    # Built afresh each call (only the parsed JSON is cached) and always as concrete arrays:
    # `train_step(..., efficiency=None)` asks for it while being traced, and an object cached
    # from inside one trace must never leak into another.
    with jax.ensure_compile_time_eval():
        return _gpu_efficiency(_default_efficiency_data(), "diffperf/presets/efficiency.json")


def default_efficiency(gpu: str | None = None) -> Efficiency:
    """The efficiency factors the library uses by default: the shipped calibration
    (`presets/efficiency.json`) if any, otherwise the physical defaults of `Efficiency()`.

    With `gpu=None` this is a `GpuEfficiency` whose leaves are the shared factors (what
    `train_step(..., efficiency=None)` uses) and which carries the per-GPU overrides; with a GPU
    id it is a plain `Efficiency` with that GPU's fitted factors (the shared ones where that
    GPU has no override).
    """
    table = _default_gpu_efficiency()
    if gpu is not None and not _gpu_entry(system_gpu(gpu)):
        raise ValueError(f"unknown gpu or system {gpu!r}; known GPUs: {', '.join(gpu_names())}; "
                         f"systems: {', '.join(system_names())}")
    return table if gpu is None else table.for_gpu(gpu)
