"""`--runtime NAME`: the software runtime a prediction assumes (`diffperf.specs.Runtime`, the
presets of `diffperf.presets.runtime_names`), its plan defaults, and the line every report
prints about it.

A runtime preset carries the host (CPU) costs of issuing the work and the plan options its
software fixes (`plan_defaults`, e.g. no GEMM-collective TP overlap in 2023 Megatron-DeepSpeed).
Those replace the command's own defaults of the plan options the user did not give; an option
given on the command line wins. Which options were given is known from a second parse in
`main` with every default suppressed (`given_options`), so the printed `--help` defaults stay
the command's own. Preset names, plan-default fields and Runtime fields are read from the
presets and the dataclass, never listed here.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .. import presets
from ..explore._what_if import parse_overrides, runtime_with_overrides, unit
from ..specs._hardware import PRECISIONS
from ..specs._inference_plan import InferencePlan
from ..specs._runtime import Runtime
from ..specs._training_plan import RECOMPUTE, TrainingPlan
from ._common import group


def _number(v: float):
    """A plan value as a command-line value: a whole number as int, else the float."""
    return int(v) if float(v).is_integer() else float(v)


#: Plan fields whose command-line option has another name or another kind of value:
#: field -> (argparse dest, plan value -> option value). Every other field's option is its
#: own name (`overlap_tp` <- `--overlap-tp`) with the number as its value.
TRAIN_OPTIONS: dict[str, tuple[str, Callable]] = {
    "recompute": ("recompute", lambda v: RECOMPUTE[int(v)]),
    "precision": ("precision", lambda v: PRECISIONS[int(v)]),
    "fp32_optimizer_moments": ("optimizer_moments", lambda v: "fp32" if v else "bf16"),
}
INFER_OPTIONS: dict[str, tuple[str, Callable]] = {
    "input_len": ("input", _number),
    "output_len": ("output", _number),
    "weight_precision": ("precision", lambda v: PRECISIONS[int(v)]),
    "activation_precision": ("activation_precision", lambda v: PRECISIONS[int(v)]),
    "kv_precision": ("kv_precision", lambda v: PRECISIONS[int(v)]),
    "flash_attention": ("no_flash", lambda v: not v),
    "grouped_decode_attention": ("per_head_decode", lambda v: not v),
}
_PLANS = {"train": (TrainingPlan, TRAIN_OPTIONS), "infer": (InferencePlan, INFER_OPTIONS)}
#: Options whose name is not their dest's (`train --flash / --no-flash` sets flash_attention).
_OPTION_NAMES = {"flash_attention": "--flash / --no-flash"}


def option_of(kind: str, name: str) -> tuple[str, Callable]:
    """(argparse dest, value conversion) of plan field `name` of a `kind` ("train" / "infer")
    plan."""
    return _PLANS[kind][1].get(name, (name, _number))


def add_runtime_argument(parser, *, what: str = "") -> None:
    """`--runtime NAME`, in the option group "software runtime"; `what`: a sentence on what
    the runtime changes in this command (appended to the help)."""
    listed = []
    for name in presets.runtime_names():
        pd = presets.runtime_plan_defaults(name)
        listed.append(name + (f" ({', '.join(f'{k}={v:g}' for k, v in pd.items())})"
                              if pd else ""))
    group(parser, "runtime").add_argument(
        "--runtime", default=None, metavar="NAME",
        help=f"software runtime preset (diffperf presets) or runtime JSON file "
             f"(docs/spec-files.md): the host (CPU) cost of issuing the "
             f"work and the plan options its software fixes, which replace the defaults of "
             f"the plan options not given on the command line (given ones win). One of: "
             f"{'; '.join(listed)}. Default {presets.DEFAULT_RUNTIME}." + (
                 f" {what}" if what else ""))


def given_options(parser: argparse.ArgumentParser, argv) -> frozenset[str]:
    """The dests of the options given on the command line `argv`: `parser` (already used for
    the real parse) parses `argv` again with every option's default suppressed (positionals
    keep theirs, and so count as given)."""
    stack, seen = [parser], set()
    while stack:
        p = stack.pop()
        if id(p) in seen:
            continue
        seen.add(id(p))
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
            elif action.option_strings:  # a positional's default is checked against its choices
                action.default = argparse.SUPPRESS
    ns = parser.parse_args(argv)
    return frozenset(vars(ns))


@dataclass
class RuntimeChoice:
    """The runtime of one command: the preset, the `--set` runtime fields applied to it, and
    the plan defaults applied (field -> value) or left out because the user gave the option
    (field -> option)."""

    name: str
    given: bool
    preset: Runtime
    runtime: Runtime
    description: str
    applied: dict = field(default_factory=dict)
    overridden: dict = field(default_factory=dict)
    set_items: list = field(default_factory=list)

    @property
    def is_default(self) -> bool:
        """The default runtime, unchanged by `--set`: predictions are today's. A runtime file
        with the default's fields and no plan defaults (the default exported) is the default."""
        if self.set_items:
            return False
        if self.name == presets.DEFAULT_RUNTIME:
            return True
        return (presets.is_spec_file(self.name) and not presets.runtime_plan_defaults(self.name)
                and runtime_fields(self.preset) == runtime_fields(presets.runtime()))

    def header(self) -> str:
        """`runtime: NAME (description; plan defaults applied: ...; ...)` for a report."""
        words = [("the default: " if not self.given else "") + self.description]
        if self.applied:
            words.append("plan defaults applied: "
                         + ", ".join(f"{k}={v:g}" for k, v in self.applied.items()))
        if self.overridden:
            words.append("plan defaults replaced by the options given: "
                         + ", ".join(f"{k} ({o})" for k, o in self.overridden.items()))
        if self.set_items:
            words.append("what-if " + " ".join(self.set_items))
        return f"runtime: {self.name} ({'; '.join(words)})"

    def to_json(self) -> dict:
        """The `"runtime"` object of `--json`."""
        return {"name": self.name, "given": self.given, "description": self.description,
                "plan_defaults_applied": dict(self.applied),
                "plan_defaults_overridden": dict(self.overridden),
                "set": list(self.set_items), "fields": runtime_fields(self.runtime)}


def has_host_times(runtime: Runtime) -> bool:
    """Whether a runtime spends any host time in inference or serving (operator, collective,
    step or per-sequence): only then does the GPU's `host_time_factor` change a prediction."""
    return any(float(getattr(runtime, f)) > 0 for f in (
        "host_op_time", "host_collective_time", "host_step_time", "host_seq_time"))


def runtime_fields(runtime: Runtime) -> dict:
    """Every field of a `Runtime` as a float (name -> value, in the field's unit), written as
    its shortest float32 form (1.9e-05, not 1.8999999156221747e-05)."""
    return {f.name: float(str(np.float32(np.asarray(getattr(runtime, f.name)))))
            for f in dataclasses.fields(Runtime)}


def resolve_runtime(args, kind: str | None) -> RuntimeChoice:
    """The `RuntimeChoice` of a parsed command line: `args.runtime` (None: the default) with the
    runtime `--set` items applied, and, for `kind` "train" or "infer", the preset's plan
    defaults for that kind of plan split into those applied (the option was not given) and
    those overridden (it was: field -> the option). `apply_plan_defaults` puts the applied ones
    on `args`."""
    name = getattr(args, "runtime", None) or presets.DEFAULT_RUNTIME
    preset = presets.runtime(name)
    items = getattr(args, "set", None)
    choice = RuntimeChoice(
        name=name, given=getattr(args, "runtime", None) is not None, preset=preset,
        runtime=runtime_with_overrides(preset, items),
        description=str(presets.runtime_info(name).get("description", "")) or (
            "a runtime file" if presets.is_spec_file(name) else ""),
        set_items=[o.text for o in parse_overrides(items) if o.part == "runtime"])
    if kind is None:
        return choice
    plan_class = _PLANS[kind][0]
    names = {f.name for f in dataclasses.fields(plan_class)}
    given = getattr(args, "_given", frozenset())
    for k, v in presets.runtime_plan_defaults(name).items():
        if k not in names:
            continue  # a default of the other kind of plan
        dest, _ = option_of(kind, k)
        if dest in given:
            choice.overridden[k] = _OPTION_NAMES.get(dest, "--" + dest.replace("_", "-"))
        else:
            choice.applied[k] = v
    return choice


def apply_plan_defaults(args, choice: RuntimeChoice, kind: str) -> dict:
    """Put the applied plan defaults of `choice` on `args` where the command has the option
    (as the option's value); returns those it has no option for (field -> value), for the
    caller to set on the plan (`with_plan_fields`)."""
    rest = {}
    for k, v in choice.applied.items():
        dest, convert = option_of(kind, k)
        if hasattr(args, dest):
            setattr(args, dest, convert(v))
        else:
            rest[k] = v
    return rest


def with_plan_fields(plan, fields: dict):
    """`plan` with the given fields replaced (plan defaults the command has no option for)."""
    return dataclasses.replace(plan, **fields) if fields else plan


def runtime_summary(name: str) -> dict:
    """A runtime preset for `diffperf presets`: name, description, plan defaults, the fields
    that differ from `Runtime()`'s defaults, and which steps it captures in CUDA graphs (the
    fields named `..._graph` that are on)."""
    rt = runtime_fields(presets.runtime(name))
    base = runtime_fields(Runtime())
    info = presets.runtime_info(name)
    return {"name": name, "default": name == presets.DEFAULT_RUNTIME,
            "description": str(info.get("description", "")),
            "graphs": [k.removesuffix("_graph") for k, v in rt.items()
                       if k.endswith("_graph") and v > 0],
            "changed_fields": {k: v for k, v in rt.items() if v != base[k]},
            "plan_defaults": presets.runtime_plan_defaults(name), "fields": rt}


def runtime_summary_text(s: dict) -> str:
    """One line of `runtime_summary` for `diffperf presets`."""
    changed = ", ".join(f"{k} {_with_unit(k, v)}" for k, v in s["changed_fields"].items()
                        if not k.endswith("_graph"))
    words = [s["description"],
             "CUDA graphs: " + (", ".join(s["graphs"]) if s["graphs"] else "none"),
             "fields unlike Runtime()'s: " + (changed or "none")]
    if s["plan_defaults"]:
        words.append("plan defaults: " + ", ".join(f"{k}={v:g}"
                                                   for k, v in s["plan_defaults"].items()))
    return f"{s['name']}{' (default)' if s['default'] else ''}: " + "; ".join(words)


def _with_unit(name: str, value: float) -> str:
    """`19 us` for a time field, `55` for a count."""
    u = unit(name)
    if u == "s":
        return f"{value * 1e6:.3g} us"
    return f"{value:g}" + (f" {u}" if u else "")
