"""GPUs, systems, models and software runtimes as JSON files, in the format of the shipped
presets (`gpus.json`, `systems.json`, `models.json`, `runtimes.json`: one entry of those
tables is one file), validated with one-line errors that name the file and the field.

A file stands for itself by its path wherever a preset id is taken (`presets.gpu(path)`,
`presets.system(path)`, `presets.chip_of(path)`, ...): the path is the name the command line
carries, prints and looks up. `diffperf presets export NAME` writes a preset as such a file;
docs/spec-files.md documents the fields.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from importlib import resources
from pathlib import Path

from .._checks import read_json
from ..specs._hardware import INTEGER_WEIGHTS, PRECISION_CODES, Accelerator, Network
from ..specs._inference_plan import InferencePlan
from ..specs._runtime import Runtime
from ..specs._training_plan import TrainingPlan
from ..specs._transformer import Transformer


def _fields(cls) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(required, optional) field names of spec class `cls` (optional: those with a default)."""
    fs = dataclasses.fields(cls)
    return (tuple(f.name for f in fs if f.default is dataclasses.MISSING),
            tuple(f.name for f in fs if f.default is not dataclasses.MISSING))


#: Text fields every kind of file may carry (ignored by the model).
_TEXT = ("name", "source", "sources", "notes", "description")
#: A GPU file's fields besides the `Accelerator`'s: the preset system whose network it uses,
#: the preset GPU whose fitted efficiency factors apply, and precisions it lacks.
GPU_EXTRA = ("system", "efficiency_of", "unsupported_precisions")
#: A model file's field besides the `Transformer`'s: the longest context it serves.
MODEL_EXTRA = ("max_context",)
#: A runtime file's field besides the `Runtime`'s: plan options its software fixes.
RUNTIME_EXTRA = ("plan_defaults",)
_NETWORK_REQUIRED, _NETWORK_OPTIONAL = _fields(Network)
_ACCEL_REQUIRED, _ACCEL_OPTIONAL = _fields(Accelerator)
_MODEL_REQUIRED, _MODEL_OPTIONAL = _fields(Transformer)
_PLAN_FIELDS = frozenset(f.name for cls in (TrainingPlan, InferencePlan)
                         for f in dataclasses.fields(cls))
#: Keys of a Hugging Face config.json that a diffperf model file never has.
HF_KEYS = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "text_config",
           "n_layer", "n_embd")


@functools.cache
def table(name: str) -> dict:
    """The shipped preset table `name` ("gpus", "systems", "models", "runtimes",
    "technology"): id -> entry, without its `_doc`-style keys."""
    text = resources.files("diffperf.presets").joinpath(f"{name}.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def _chip(gpu_id: str) -> str:
    """The preset GPU whose fitted factors GPU preset `gpu_id` uses (its `efficiency_of`)."""
    return table("gpus")[gpu_id].get("efficiency_of", gpu_id)


def is_file_name(name) -> bool:
    """Whether a command-line value names a spec file: it ends in `.json` or is an existing
    file (callers look preset ids up first)."""
    s = str(name)
    return s.lower().endswith(".json") or Path(s).is_file()


def _check_object(where: str, data, required, optional) -> dict:
    """`data` without its `_comment`-style keys; a ValueError naming the first unknown or
    missing field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object {{field: value}}, got "
                         f"{type(data).__name__}")
    known = (*required, *optional)
    for k in data:
        if k not in known and not str(k).startswith("_"):
            raise ValueError(f"{where}: unknown field {k!r}; known: {', '.join(known)}")
    for k in required:
        if k not in data:
            raise ValueError(f"{where}: missing required field {k!r}")
    return {k: v for k, v in data.items() if not str(k).startswith("_")}


def _check_numbers(where: str, data: dict, names) -> None:
    for k in names:
        if k in data and (isinstance(data[k], bool) or not isinstance(data[k], (int, float))):
            raise ValueError(f"{where}: field {k!r} must be a number, got {data[k]!r}")


def _check_texts(where: str, data: dict) -> None:
    for k in _TEXT:
        if k in data and not isinstance(data[k], str):
            raise ValueError(f"{where}: field {k!r} must be a string, got {data[k]!r}")


def _build(where: str, cls, values: dict):
    """`cls(**values)`, its `__check_init__`'s range error prefixed by `where`."""
    try:
        return cls(**values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _preset_id(where: str, field: str, value, ids: list[str], what: str) -> str:
    key = value.lower() if isinstance(value, str) else None
    if key not in ids:
        raise ValueError(f"{where}: field {field!r} must be a {what} preset id ({', '.join(ids)})"
                         f", got {value!r}")
    return key


# ------------------------------------------------------------------------------- hardware
@dataclasses.dataclass(frozen=True)
class Hardware:
    """A validated GPU or system file: `gpu` is the GPU's row (a gpus.json entry), `system`
    the system's (a systems.json entry, None for a GPU file); `gpu_name` names the GPU (a preset
    id, a GPU file, or for a nested GPU object the system file itself)."""

    gpu: dict
    system: dict | None
    gpu_name: str


def _gpu_row(where: str, data, nested: bool = False) -> dict:
    extra = GPU_EXTRA[1:] if nested else GPU_EXTRA  # a system's own GPU uses its network
    row = _check_object(where, data, _ACCEL_REQUIRED, (*_ACCEL_OPTIONAL, *extra, *_TEXT))
    _check_numbers(where, row, (*_ACCEL_REQUIRED, *_ACCEL_OPTIONAL))
    _check_texts(where, row)
    if "system" in row:
        row["system"] = _preset_id(where, "system", row["system"], sorted(table("systems")),
                                   "system")
    if "efficiency_of" in row:  # the chip it names: an H800 named here stands for the H100
        row["efficiency_of"] = _chip(_preset_id(where, "efficiency_of", row["efficiency_of"],
                                                sorted(table("gpus")), "GPU"))
    missing = row.get("unsupported_precisions", {})
    names = sorted({*PRECISION_CODES, *INTEGER_WEIGHTS})
    if not isinstance(missing, dict) or not all(
            isinstance(k, str) and k.lower() in names and isinstance(v, str)
            for k, v in missing.items()):
        raise ValueError(f"{where}: field 'unsupported_precisions' must be an object "
                         f"{{precision: why}} with precisions among {', '.join(names)}, got "
                         f"{missing!r}")
    if missing:
        row["unsupported_precisions"] = {k.lower(): v for k, v in missing.items()}
    _build(where, Accelerator, {f: row[f] for f in (*_ACCEL_REQUIRED, *_ACCEL_OPTIONAL)
                                if f in row})
    return row


def _is_system(data) -> bool:
    """A system file has a `gpu` or network fields; a GPU file has neither."""
    return isinstance(data, dict) and ("gpu" in data or any(
        k in data for k in (*_NETWORK_REQUIRED, *_NETWORK_OPTIONAL)))


def _hardware(path: str) -> Hardware:
    data = read_json(path, "gpu or system file")
    if not _is_system(data):
        return Hardware(_gpu_row(f"gpu file {path}", data), None, path)
    where = f"system file {path}"
    row = _check_object(where, data, (*_NETWORK_REQUIRED, "gpu"), (*_NETWORK_OPTIONAL, *_TEXT))
    _check_numbers(where, row, (*_NETWORK_REQUIRED, *_NETWORK_OPTIONAL))
    _check_texts(where, row)
    _build(where, Network, {f: row[f] for f in (*_NETWORK_REQUIRED, *_NETWORK_OPTIONAL)
                            if f in row})
    value = row["gpu"]
    if isinstance(value, dict):
        gpu = _gpu_row(f"{where}, field 'gpu'", value, nested=True)
        name = path
    elif isinstance(value, str) and value.lower() in table("gpus"):
        name = value.lower()
        gpu = table("gpus")[name]
    elif isinstance(value, str) and is_file_name(Path(path).parent / value):
        name = str(Path(path).parent / value)  # relative to the system file's folder
        inner = read_json(name, f"{where}: field 'gpu': gpu file")
        if _is_system(inner):
            raise ValueError(f"{where}: field 'gpu' names {value}, a system file, not a GPU "
                             f"file")
        gpu = _gpu_row(f"gpu file {name}", inner)
    else:
        raise ValueError(f"{where}: field 'gpu' must be a GPU preset id "
                         f"({', '.join(sorted(table('gpus')))}), a GPU file's path or a GPU "
                         f"object, got {value!r}")
    return Hardware(gpu, {**row, "gpu": name}, name)


def _stamp(path: str):
    """What changes when the file does, so that an edited file is read again: its absolute
    path (a relative one names another file in another working directory, as in a
    `diffperf daemon`), device, inode, size and modification and change times (a copy with
    the original's modification time, `cp -p`, still has its own inode and change time)."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
            st.st_ctime_ns)


@functools.lru_cache(maxsize=256)
def _cached(kind: str, path: str, stamp) -> Hardware | dict:
    del stamp  # part of the key only
    if kind == "hardware":
        return _hardware(path)
    return _model(path) if kind == "model" else _runtime(path)


def hardware(path) -> Hardware:
    """The validated GPU or system file `path` (a ValueError naming the file and the field)."""
    out = _cached("hardware", str(path), _stamp(str(path)))
    assert isinstance(out, Hardware)
    return out


def gpu_system(path) -> str:
    """The preset system whose network a GPU file's GPU uses (its `system` field)."""
    h = hardware(path)
    if h.system is not None:
        raise ValueError(f"system file {path} is a system, not a GPU")
    if "system" not in h.gpu:
        raise ValueError(f"gpu file {path} names no 'system' whose network it uses: add e.g. "
                         f"\"system\": \"dgx-h100\" to it (train and search train also take "
                         f"--system)")
    return h.gpu["system"]


# ----------------------------------------------------------------------- models, runtimes
def is_model_file(data) -> bool:
    """Whether parsed JSON is a diffperf model file (`layers`, `hidden`, ...) rather than a
    Hugging Face config.json (`model_type`, `hidden_size`, `num_hidden_layers`, ...)."""
    return (isinstance(data, dict) and ("layers" in data or "hidden" in data)
            and not any(k in data for k in HF_KEYS))


def _model(path: str) -> dict:
    where = f"model file {path}"
    data = read_json(path, "model file")
    if isinstance(data, dict) and any(k in data for k in HF_KEYS):
        raise ValueError(f"{where} is a Hugging Face config.json (it has "
                         f"{next(k for k in HF_KEYS if k in data)!r}): read it with "
                         f"diffperf.transformer_from_hf_config")
    row = _check_object(where, data, _MODEL_REQUIRED,
                        (*_MODEL_OPTIONAL, *MODEL_EXTRA, *_TEXT))
    _check_numbers(where, row, (*_MODEL_REQUIRED, *_MODEL_OPTIONAL, *MODEL_EXTRA))
    _check_texts(where, row)
    fields = {f: row[f] for f in (*_MODEL_REQUIRED, *_MODEL_OPTIONAL) if f in row}
    _build(where, Transformer, fields)
    if "max_context" in row:
        try:
            Transformer(**fields | {"seq_len": row["max_context"]})
        except ValueError as e:
            raise ValueError(f"{where}: max_context: {str(e).replace('seq_len', 'max_context')}"
                             ) from None
    return row


def _runtime(path: str) -> dict:
    where = f"runtime file {path}"
    names = tuple(f.name for f in dataclasses.fields(Runtime))
    row = _check_object(where, read_json(path, "runtime file"), (),
                        (*names, *RUNTIME_EXTRA, *_TEXT))
    _check_numbers(where, row, names)
    _check_texts(where, row)
    _build(where, Runtime, {f: row[f] for f in names if f in row})
    defaults = row.get("plan_defaults", {})
    if not isinstance(defaults, dict):
        raise ValueError(f"{where}: field 'plan_defaults' must be an object {{plan field: "
                         f"number}}, got {defaults!r}")
    for k, v in defaults.items():
        if k not in _PLAN_FIELDS:
            raise ValueError(f"{where}: plan_defaults: unknown plan field {k!r}; known: "
                             f"{', '.join(sorted(_PLAN_FIELDS))}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{where}: plan_defaults: field {k!r} must be a finite number, "
                             f"got {v!r}")
    return row


def model_row(path) -> dict:
    """The validated model file `path` (a models.json entry)."""
    out = _cached("model", str(path), _stamp(str(path)))
    assert isinstance(out, dict)
    return out


def runtime_row(path) -> dict:
    """The validated runtime file `path` (a runtimes.json entry)."""
    out = _cached("runtime", str(path), _stamp(str(path)))
    assert isinstance(out, dict)
    return out


def row(kind: str, path: str) -> dict:
    """The entry of preset table `kind` ("gpus", "systems", "models", "runtimes") that file
    `path` holds: a system file's GPU for "gpus"."""
    if kind == "gpus":
        return hardware(path).gpu
    if kind == "systems":
        h = hardware(path)
        if h.system is None:
            raise ValueError(f"gpu file {path} is a GPU, not a system (its network is the "
                             f"'system' it names)")
        return h.system
    return model_row(path) if kind == "models" else runtime_row(path)


# --------------------------------------------------------------------------------- export
def export(key: str) -> dict:
    """The file of preset `key` (a GPU, system, model or runtime id), in the format the
    loaders read: a GPU with `efficiency_of` (its chip, whose fitted factors it uses), a
    system with its GPU as a nested object, so that the file predicts what the id does."""
    for kind in ("models", "runtimes"):
        if key in table(kind):
            return dict(table(kind)[key])
    if key in table("gpus"):
        return _gpu_export(key, keep_system=True)
    row = dict(table("systems")[key])
    row["gpu"] = _gpu_export(row["gpu"], keep_system=False)
    return row


def _gpu_export(key: str, keep_system: bool) -> dict:
    out, row = {}, table("gpus")[key]
    if "name" in row:
        out["name"] = row["name"]
    out |= {f: row[f] for f in (*_ACCEL_REQUIRED, *_ACCEL_OPTIONAL) if f in row}
    if keep_system:
        out["system"] = row["system"]
    out["efficiency_of"] = _chip(key)
    return out | {k: v for k, v in row.items() if k not in out and k != "system"}
