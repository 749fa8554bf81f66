"""What-if hardware and software: `--set hbm_bandwidth=x2` changes one Accelerator / Network
parameter of a preset system, `--set host_op_time=2e-5` one field of the preset software runtime
(`Runtime`), so `train`, `infer` and `search` answer "what if HBM bandwidth doubled?" or "what if
the framework issued an operator in 2 us?".

An override is `FIELD=VALUE` (the value in the field's SI unit, e.g. `hbm_bandwidth=6.7e12`
B/s) or `FIELD=xFACTOR` (a multiple of the preset's value, e.g. `nvlink_bandwidth=x2`). FIELD
is a field of `Accelerator`, `Network` or `Runtime` (`hbm_bandwidth`, or
`accelerator.hbm_bandwidth`; `runtime.decode_graph`). No two of them share a field name, so a
bare name is never ambiguous. The changed specs are rebuilt through their constructors, so their
range checks apply.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from .._checks import MAX_EXACT_COUNT
from ..specs._hardware import Accelerator, Network, System
from ..specs._runtime import Runtime

#: The specs `--set` reaches: the system's two parts and the software runtime.
_PARTS = {"accelerator": Accelerator, "network": Network, "runtime": Runtime}
#: Those of a `System` (`apply_overrides`); the rest (`Runtime`) has `apply_runtime_overrides`.
_SYSTEM_PARTS = ("accelerator", "network")

#: The smallest normal and the largest float32: values outside would become 0 or inf.
FLOAT32_TINY, FLOAT32_MAX = 1.1754944e-38, 3.4028235e38

#: Units of the fields, for the printed comparison (`describe`).
UNITS = {
    "flops_fp32": "FLOP/s", "flops_bf16": "FLOP/s", "flops_fp8": "FLOP/s", "flops_fp4": "FLOP/s",
    "vector_flops": "FLOP/s", "hbm_capacity": "B", "hbm_bandwidth": "B/s", "l2_capacity": "B",
    "l2_bandwidth": "B/s", "num_sms": "count", "launch_overhead": "s", "host_bandwidth": "B/s",
    "host_memory_bandwidth": "B/s", "host_time_factor": "x",
    "host_memory": "B", "nvlink_domain": "GPUs", "nvlink_bandwidth": "B/s",
    "nvlink_latency": "s", "scaleout_bandwidth": "B/s", "scaleout_latency": "s",
    "nvlink_sharp": "0/1",
}


def unit(field: str) -> str:
    """The unit of a `--set` field for printing: `UNITS`, else s for a runtime's `..._time`
    fields (the `Runtime` docstring's unit), else none."""
    return UNITS.get(field, "s" if field.endswith("_time") else "")


def _fields(part: str) -> list[str]:
    return [f.name for f in dataclasses.fields(_PARTS[part])]


def _check_distinct_names() -> None:
    """A bare `--set FIELD` names one spec only: no field name is shared between them."""
    seen: dict[str, str] = {}
    for part in _PARTS:
        for f in _fields(part):
            assert f not in seen, f"--set field {f!r} is in both {seen[f]} and {part}"
            seen[f] = part


_check_distinct_names()


class Override(NamedTuple):
    """One `--set`: `part` ("accelerator" / "network" / "runtime"), `field`, and either an
    absolute value (`factor` False) or a multiple of the preset's (`factor` True)."""
    part: str
    field: str
    value: float
    factor: bool

    @property
    def text(self) -> str:
        return f"{self.field}={'x' if self.factor else ''}{self.value:g}"


def parse_override(item: str) -> Override:
    """Parse one `FIELD=VALUE` or `FIELD=xFACTOR`; ValueError naming the item otherwise."""
    name, sep, raw = item.partition("=")
    name, raw = name.strip(), raw.strip()
    if not sep or not name or not raw:
        raise ValueError(f"--set {item!r}: expected FIELD=VALUE or FIELD=xFACTOR, e.g. "
                         f"hbm_bandwidth=x2 or nvlink_domain=72")
    part, _, field = name.rpartition(".")
    owners = [p for p in _PARTS if field in _fields(p) and part in ("", p)]
    if not owners:
        known = "; ".join(f"{p}: {', '.join(_fields(p))}" for p in _PARTS)
        raise ValueError(f"--set {item!r}: unknown hardware field {name!r} (nor a runtime "
                         f"field); fields of {known}")
    factor = raw[0] in "xX*"
    try:
        value = float(raw[1:] if factor else raw)
    except ValueError:
        raise ValueError(f"--set {item!r}: {raw!r} is not a number (or xFACTOR)") from None
    if not math.isfinite(value) or value < 0 or (factor and value == 0):
        raise ValueError(f"--set {item!r}: the {'factor' if factor else 'value'} must be a finite "
                         f"{'positive' if factor else 'non-negative'} number, got {raw!r}"
                         + ("" if factor else " (0 only for latencies and overheads; rates "
                                              "and capacities must be > 0)"))
    return Override(owners[0], field, value, factor)


def parse_overrides(items) -> list[Override]:
    """Parse every `--set` item; a field set twice is an error (which one would win?)."""
    out = [parse_override(i) for i in items or []]
    seen = set()
    for o in out:
        if o.field in seen:
            raise ValueError(f"--set {o.field} is given twice")
        seen.add(o.field)
    return out


def _changed(spec, part: str, overrides: list[Override]):
    """`spec` (an `Accelerator`, `Network` or `Runtime`) with the overrides of `part` applied,
    rebuilt through its constructor (range checks run); `spec` itself when none applies."""
    mine = [o for o in overrides if o.part == part]
    if not mine:
        return spec
    values = {f: getattr(spec, f) for f in _fields(part)}
    for o in mine:
        if o.factor and float(values[o.field]) == 0 and o.value != 1:
            raise ValueError(f"--set {o.text}: {o.field} is 0 in the preset, and a multiple "
                             f"of 0 stays 0; give a value ({o.field}=...)")
        v = float(values[o.field]) * o.value if o.factor else o.value
        if UNITS.get(o.field) in ("count", "GPUs") and v > MAX_EXACT_COUNT:
            raise ValueError(f"--set {o.text}: {o.field} must be <= {MAX_EXACT_COUNT} (2^24: "
                             f"larger counts are not exact in float32), got {v:g}")
        if v != 0 and not FLOAT32_TINY <= v <= FLOAT32_MAX:
            raise ValueError(f"--set {o.text}: {v:g} {unit(o.field)} is outside the "
                             f"range of the model's float32 arithmetic")
        values[o.field] = v
    try:
        return _PARTS[part](**values)
    except ValueError as e:
        raise ValueError(f"--set {' '.join(o.text for o in mine)}: {e}") from None


def apply_overrides(system: System, overrides: list[Override]) -> System:
    """`system` with the hardware overrides applied (the specs rebuilt, so range checks run: a
    fractional `num_sms` or a zero bandwidth is a ValueError naming the field); runtime
    overrides are left to `apply_runtime_overrides`."""
    for part in _SYSTEM_PARTS:
        spec = getattr(system, part)
        changed = _changed(spec, part, overrides)
        if changed is not spec:
            system = dataclasses.replace(system, **{part: changed})
    return system


def apply_runtime_overrides(runtime: Runtime, overrides: list[Override]) -> Runtime:
    """`runtime` with the `Runtime` overrides applied (rebuilt, so its range checks run: a
    negative host time or a `decode_graph` above 1 is a ValueError naming the field)."""
    return _changed(runtime, "runtime", overrides)


def describe(base: System, changed: System, overrides: list[Override],
             base_runtime: Runtime | None = None,
             changed_runtime: Runtime | None = None) -> list[str]:
    """One line per override: `hbm_bandwidth 2.039e+12 -> 4.078e+12 B/s (x2)`; a runtime
    field's values are those of `base_runtime` and `changed_runtime` (default `Runtime()`)."""
    runtimes = (base_runtime or Runtime(), changed_runtime or Runtime())
    lines = []
    for o in overrides:
        b, c = (float(getattr(rt if o.part == "runtime" else getattr(sys_, o.part), o.field))
                for sys_, rt in zip((base, changed), runtimes))
        ratio = f" (x{c / b:.3g})" if b > 0 else ""
        note = (" (the FLOP/s stay: num_sms only sets GEMM wave quantisation and split-K; "
                "change flops_* too for a smaller or larger GPU)" if o.field == "num_sms" else "")
        lines.append(f"{o.field} {b:.4g} -> {c:.4g} {unit(o.field)}{ratio}{note}")
    return lines


def comparison(base: System, changed: System, items, preset: dict,
               base_runtime: Runtime | None = None, runtime: Runtime | None = None) -> dict:
    """The `what_if` object of `train` / `infer --json`: the `--set` items, the changes as
    `describe` words them and the `preset` system's (and runtime's) numbers."""
    overrides = parse_overrides(items)
    return {"set": [o.text for o in overrides],
            "changes": describe(base, changed, overrides, base_runtime, runtime),
            "preset": preset}


def change(base: float, new: float, unit: str = "", relative: bool = True) -> str:
    """`18.47 s -> 17.82 s (-3.5 %)`: two values and, with `relative`, their relative change."""
    u = f" {unit}" if unit else ""
    pct = f" ({(new / base - 1) * 100:+.1f} %)" if relative and base else ""
    return f"{base:.4g}{u} -> {new:.4g}{u}{pct}"


def add_set_argument(parser) -> None:
    """The repeatable `--set FIELD=VALUE|xFACTOR` option of train / infer / search /
    sensitivity."""
    parser.add_argument("--set", action="append", default=None, metavar="FIELD=VALUE",
                        help="what-if hardware or software: change one GPU / network parameter "
                             "of the preset, or one field of the --runtime, as an SI value "
                             "(hbm_bandwidth=6.7e12, host_op_time=2e-5) or a multiple "
                             "(hbm_bandwidth=x2); repeatable. Fields: those of Accelerator, "
                             "Network and Runtime (README, 'What-if hardware'; "
                             "docs/runtime.md)")


def tag(items) -> str:
    """` [what-if hbm_bandwidth=x2]` for the header of an output, or "" without `--set`."""
    return f" [what-if {' '.join(o.text for o in parse_overrides(items))}]" if items else ""


def system_with_overrides(system: System, items) -> System:
    """`system` with the hardware `--set` items applied (`system` itself when there are
    none)."""
    overrides = parse_overrides(items)
    return apply_overrides(system, overrides) if overrides else system


def runtime_with_overrides(runtime: Runtime, items) -> Runtime:
    """`runtime` with the runtime `--set` items applied (`runtime` itself when there are
    none)."""
    overrides = parse_overrides(items)
    return apply_runtime_overrides(runtime, overrides) if overrides else runtime
