"""Small helpers shared by the spec modules: array conversion and input validation.

Validation runs only on concrete values (a spec built inside `jit`/`vmap` holds tracers and is
checked by the feasibility logic of the phase models instead).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import MappingProxyType

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

#: Largest count (layers, widths, lengths, GPUs, batch) accepted from the command line, a
#: Hugging Face config or a benchmark CSV: float32 represents every integer only up to 2^24, so a
#: larger count would be silently rounded (and means a typo, e.g. a 10^12-token context).
MAX_EXACT_COUNT = 2 ** 24

#: Arrays of Python numbers already converted, by (exact value, dtype): building a spec from
#: Python numbers is then ~10x faster (spec fields repeat the same few values).
_SCALARS: dict = {}


def as_float(x) -> jax.Array:
    """Convert to a floating JAX array of the default float dtype (float32, or float64 with x64)."""
    dtype = jnp.result_type(float)
    if type(x) not in (int, float):
        return jnp.asarray(x, dtype=dtype)
    try:
        x = float(x)
    except OverflowError:  # an int beyond the float range (e.g. from JSON): +-inf, which the
        x = float("inf") if x > 0 else float("-inf")  # range checks then reject by name
    key = (x.hex(), dtype)
    a = _SCALARS.get(key)
    if a is None or a.is_deleted():  # deleted: a caller donated a spec leaf
        a = jnp.asarray(x, dtype=dtype)
        if isinstance(a, jax.core.Tracer):  # built while tracing: never keep a tracer
            return a
        if len(_SCALARS) < 4096:
            _SCALARS[key] = a
    return a


def named_code(owner: str, field: str, codes: dict[str, int]):
    """An `eqx.field` converter for a categorical field: a name of `codes` (any case) becomes
    its integer code, a number passes through (`as_float`); an unknown name is a ValueError
    naming `owner.field`, the choices and the value."""
    def convert(x):
        if isinstance(x, str):
            try:
                x = codes[x.lower()]
            except KeyError:
                raise ValueError(f"{owner}.{field} must be one of {sorted(codes)}, "
                                 f"got {x!r}") from None
        return as_float(x)
    return convert


def number_field(**kwargs):
    """An `eqx.field` converted by `as_float` (keywords: `eqx.field`'s). Decorate its class with
    `names_number_fields` so that a value that is not a number names the field."""
    return eqx.field(converter=as_float, **kwargs)


def names_number_fields(cls):
    """Class decorator: each `number_field` of spec class `cls` converts with an error naming
    it (`TrainingPlan.tp must be a number or an array of numbers, got None`), not JAX's. The
    class and field names come from the class itself."""
    for f in dataclasses.fields(cls):
        if f.metadata.get("converter") is as_float:
            f.metadata = MappingProxyType({**f.metadata,
                                           "converter": _named(cls.__name__, f.name)})
    return cls


def _named(owner: str, name: str):
    def convert(x):
        try:
            return as_float(x)
        except (TypeError, ValueError):
            raise ValueError(f"{owner}.{name} must be a number or an array of numbers, got "
                             f"{x!r}") from None
    return convert


def is_concrete(*values) -> bool:
    """True when none of `values` is a tracer (so they can be inspected in Python)."""
    return not any(isinstance(v, jax.core.Tracer) for v in values)


def _values(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _show(v: np.ndarray) -> str:
    return f"{v.item():g}" if v.size == 1 else f"{v.tolist()}"


def check_positive(owner: str, name: str, x) -> None:
    """Raise ValueError unless every element of `x` is finite and > 0."""
    if not is_concrete(x):
        return
    v = _values(x)
    bad = ~np.isfinite(v) | (v <= 0)
    if bad.any():
        raise ValueError(f"{owner}.{name} must be a finite number > 0, "
                         f"got {_show(v[bad].ravel()[:1])}")


def check_nonnegative(owner: str, name: str, x) -> None:
    """Raise ValueError unless every element of `x` is finite and >= 0."""
    if not is_concrete(x):
        return
    v = _values(x)
    bad = ~np.isfinite(v) | (v < 0)
    if bad.any():
        raise ValueError(f"{owner}.{name} must be a finite number >= 0, "
                         f"got {_show(v[bad].ravel()[:1])}")


def check_at_least(owner: str, name: str, x, minimum: float) -> None:
    """Raise ValueError unless every element of `x` is finite and >= `minimum`."""
    if not is_concrete(x):
        return
    v = _values(x)
    bad = ~np.isfinite(v) | (v < minimum)
    if bad.any():
        raise ValueError(f"{owner}.{name} must be a finite number >= {minimum:g}, "
                         f"got {_show(v[bad].ravel()[:1])}")


def check_integer(owner: str, name: str, x, minimum: float = 1) -> None:
    """Raise ValueError unless every element of `x` is a whole number >= `minimum`."""
    if not is_concrete(x):
        return
    v = _values(x)
    bad = ~np.isfinite(v) | (v < minimum) | (np.round(v) != v)
    if bad.any():
        raise ValueError(
            f"{owner}.{name} must be a whole number >= {minimum:g}, got {_show(v[bad].ravel()[:1])}"
        )


def check_fraction(owner: str, name: str, x, allow_zero: bool = True) -> None:
    """Raise ValueError unless every element of `x` lies in [0, 1] (or (0, 1])."""
    if not is_concrete(x):
        return
    v = _values(x)
    low_bad = (v < 0) if allow_zero else (v <= 0)
    bad = ~np.isfinite(v) | low_bad | (v > 1)
    if bad.any():
        rng = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{owner}.{name} must lie in {rng}, got {_show(v[bad].ravel()[:1])}")


def check_choice(owner: str, name: str, x, choices: dict[int, str]) -> None:
    """Raise ValueError unless every element of `x` is one of the integer codes in `choices`."""
    if not is_concrete(x):
        return
    v = _values(x)
    bad = ~np.isin(v, list(choices))
    if bad.any():
        names = ", ".join(f"{k}={n}" for k, n in choices.items())
        raise ValueError(f"{owner}.{name} must be one of {names}; got {_show(v[bad].ravel()[:1])}")


def check_divides(owner: str, small: str, a, big: str, b) -> None:
    """Raise ValueError unless `a` divides `b` elementwise."""
    if not is_concrete(a, b):
        return
    va, vb = _values(a), _values(b)
    bad = np.mod(vb, va) != 0
    if np.any(bad):
        va_b = np.broadcast_to(va, bad.shape)[bad].ravel()[0]
        vb_b = np.broadcast_to(vb, bad.shape)[bad].ravel()[0]
        raise ValueError(f"{owner}.{small}={va_b:g} does not divide {owner}.{big}={vb_b:g}")


def check_finite_report(report, what: str, sizes: str) -> None:
    """Raise ValueError when any numeric field of a concrete `report` (an equinox module of
    arrays) is NaN or infinite, naming those fields and the input `sizes` (the usual cause:
    lengths or counts so large that float32 arithmetic overflows). A report never reaches the
    user with a silent NaN."""
    bad = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(eqx.filter(report, eqx.is_array))[0]:
        a = np.asarray(leaf)
        if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            bad.append(jax.tree_util.keystr(path).lstrip("."))
    if bad:
        shown = ", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
        raise ValueError(f"{what} is not finite: {shown} came out NaN or infinite for "
                         f"{sizes} (usually sizes too large for float32 arithmetic)")


def read_json(path, what: str):
    """The parsed JSON of file `path`, or a ValueError naming `what` and the file when it is
    missing, not UTF-8 text or not valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {path} is a directory, not a JSON file") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not UTF-8 text (a JSON file?)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON: {e}") from None
