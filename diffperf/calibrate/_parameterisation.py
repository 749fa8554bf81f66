"""The unconstrained vector a calibration optimises: fractions as sigmoid(u), positive factors
as default * softplus(u) / log 2, plus per-GPU offsets for the factors grouped by GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ..specs._efficiency import Efficiency

#: Factors in (0, 1): parameterised as sigmoid(u).
FRACTION_FIELDS = ("matmul_peak", "matmul_lowp", "attention", "vector", "hbm", "l2", "nvlink",
                   "all_to_all", "scaleout", "tp_overlap", "dp_overlap", "pp_overlap", "cp_overlap",
                   "zero3_overlap", "per_head_attention", "prefill_attention")
#: Positive factors: parameterised as default * softplus(u) / log(2).
POSITIVE_FIELDS = ("matmul_size_scale", "kernel_overhead", "collective_overhead",
                   "memory_reserve", "host_overhead")
ALL_FIELDS = tuple(Efficiency.__dataclass_fields__)
#: Fitted by default: every factor that changes a time (memory_reserve only moves the HBM
#: capacity check, which has no gradient), but prefill_attention, which is set from measured
#: kernels (`benchmarks_data/attention_kernels_published.csv`), not from end-to-end rows.
DEFAULT_FIELDS = tuple(f for f in ALL_FIELDS if f not in ("memory_reserve", "prefill_attention"))
#: Factors that legitimately differ between GPU generations (tensor-core and HBM generations,
#: kernel launch / tail cost, NCCL software latency); everything else (overlaps, network
#: fractions, the GEMM size scale) is shared.
GPU_FIELDS = ("matmul_peak", "matmul_lowp", "attention", "hbm", "kernel_overhead",
              "collective_overhead")
DEFAULT_GROUPING = {f: "gpu" for f in GPU_FIELDS}
#: A fraction whose default is 0 or 1 starts (and is pulled toward) this far inside (0, 1).
FRACTION_CLIP = 0.02

def enable_x64() -> None:
    """Switch JAX to float64 (call before building specs, so their leaves are float64)."""
    jax.config.update("jax_enable_x64", True)


def _logit(p: float) -> float:
    p = min(max(p, FRACTION_CLIP), 1.0 - FRACTION_CLIP)
    return math.log(p / (1.0 - p))


def _softplus_inv(y: float) -> float:
    return y + math.log(-math.expm1(-y)) if y < 30 else y


@dataclass(frozen=True)
class Parameterisation:
    """Layout of the unconstrained vector `theta = [u_shared (F), delta (G x Fg)]`.

    - `fields`: fitted factors (the others keep `base` values).
    - `grouped`: the fitted factors that get a per-GPU offset.
    - `groups`: GPU ids with an offset (the GPUs present in the data).
    - `base`: values of every factor (the non-fitted ones are used as is).
    - `center`: physical defaults the prior pulls toward (and the softplus scales).
    """

    fields: tuple
    grouped: tuple
    groups: tuple
    base: tuple  # ((field, value), ...)
    center: tuple  # ((field, value), ...)

    @staticmethod
    def build(fields=None, grouping=None, groups=(), base: Efficiency | dict | None = None):
        fields = tuple(DEFAULT_FIELDS if fields is None else fields)
        unknown = [f for f in fields if f not in ALL_FIELDS]
        if unknown:
            raise ValueError(f"unknown efficiency factor(s) {unknown}; known: {list(ALL_FIELDS)}")
        grouping = DEFAULT_GROUPING if grouping is None else grouping
        for f, key in grouping.items():
            if f not in ALL_FIELDS:
                raise ValueError(f"grouping: unknown factor {f!r}")
            if key not in ("gpu", None, "none"):
                raise ValueError(f"grouping: factor {f!r} can be grouped by 'gpu' only, "
                                 f"got {key!r}")
        grouped = tuple(f for f in fields if grouping.get(f) == "gpu") if groups else ()
        phys = Efficiency()
        center = tuple((f, float(getattr(phys, f))) for f in ALL_FIELDS)
        if base is None:
            base_vals = dict(center)
        elif isinstance(base, dict):
            base_vals = {**dict(center), **{k: float(v) for k, v in base.items()}}
        else:
            base_vals = {f: float(getattr(base, f)) for f in ALL_FIELDS}
        return Parameterisation(fields, grouped, tuple(groups) if grouped else (),
                                tuple(base_vals.items()), center)

    @property
    def n_shared(self) -> int:
        return len(self.fields)

    @property
    def size(self) -> int:
        return len(self.fields) + len(self.groups) * len(self.grouped)

    def names(self) -> list[str]:
        """Human names of the entries of theta."""
        return list(self.fields) + [f"{g}:{f}" for g in self.groups for f in self.grouped]

    def _scale(self, f: str) -> float:
        return max(dict(self.center)[f], 1e-12) / math.log(2.0)

    def to_value(self, f: str, u):
        """Factor value from its unconstrained coordinate (works on floats and arrays)."""
        if f in FRACTION_FIELDS:
            return jax.nn.sigmoid(u)
        return self._scale(f) * jnp.logaddexp(u, 0.0)

    def from_value(self, f: str, v: float) -> float:
        if f in FRACTION_FIELDS:
            return _logit(float(v))
        return _softplus_inv(max(float(v), 1e-30) / self._scale(f))

    def prior_center(self) -> np.ndarray:
        c = dict(self.center)
        return np.array([self.from_value(f, c[f]) for f in self.fields])

    def theta_from(self, start: Efficiency | dict | None = None) -> np.ndarray:
        """theta of a start point (shared values; offsets 0). Default: the physical defaults."""
        vals = dict(self.center)
        if isinstance(start, dict):
            vals.update({k: float(v) for k, v in start.items()})
        elif start is not None:
            vals.update({f: float(getattr(start, f)) for f in ALL_FIELDS})
        u = [self.from_value(f, vals[f]) for f in self.fields]
        return np.concatenate([np.array(u), np.zeros(len(self.groups) * len(self.grouped))])

    def split(self, theta):
        nf = self.n_shared
        return theta[:nf], theta[nf:].reshape(len(self.groups), len(self.grouped))

    def efficiency(self, theta, gpu: str | None = None) -> Efficiency:
        """The (scalar) `Efficiency` of GPU `gpu` (None, or a GPU without offsets: shared)."""
        u, delta = self.split(theta)
        gi = self.groups.index(gpu) if gpu in self.groups else None
        vals = dict(self.base)
        for i, f in enumerate(self.fields):
            ui = u[i]
            if gi is not None and f in self.grouped:
                ui = ui + delta[gi, self.grouped.index(f)]
            vals[f] = self.to_value(f, ui)
        return Efficiency(**vals)

    def row_efficiency(self, theta, group_idx) -> Efficiency:
        """A stacked `Efficiency` with one entry per row (`group_idx`: the row's index into
        `groups`, or -1 for a GPU without offsets)."""
        n = group_idx.shape[0]
        u, delta = self.split(theta)
        has = group_idx >= 0
        gi = jnp.where(has, group_idx, 0)
        vals = {f: jnp.full((n,), v) for f, v in self.base}
        for i, f in enumerate(self.fields):
            ui = jnp.full((n,), u[i])
            if f in self.grouped and len(self.groups):
                ui = ui + jnp.where(has, delta[gi, self.grouped.index(f)], 0.0)
            vals[f] = self.to_value(f, ui)
        return Efficiency(**vals)

    def factors(self, theta) -> tuple[dict, dict]:
        """(shared factors, {gpu: overrides}) as plain floats (all factors in `shared`)."""
        theta = np.asarray(theta, dtype=np.float64)
        shared_eff = self.efficiency(theta, None)
        shared = {f: float(getattr(shared_eff, f)) for f in ALL_FIELDS}
        per_gpu = {}
        for g in self.groups:
            e = self.efficiency(theta, g)
            per_gpu[g] = {f: float(getattr(e, f)) for f in self.grouped}
        return shared, per_gpu

    def to_json(self) -> dict:
        return {"fields": list(self.fields), "grouped": list(self.grouped),
                "groups": list(self.groups), "base": dict(self.base),
                "center": dict(self.center)}

    @staticmethod
    def from_json(d: dict) -> Parameterisation:
        """Inverse of `to_json`; ValueError naming the key when the layout is not one
        `build` could have written (unknown or non-string factor names, a grouped factor that
        is not fitted, a base or center value missing or not a finite number)."""
        for key in ("fields", "grouped", "groups"):
            if not isinstance(d[key], list):
                raise ValueError(f"{key!r} must be a list of names, got {d[key]!r}")
            bad = [x for x in d[key] if not isinstance(x, str)]
            if bad:
                raise ValueError(f"{key!r} must hold names, got {bad[0]!r}")
        unknown = sorted(set(f for f in d["fields"] if f not in ALL_FIELDS))
        if unknown:
            raise ValueError(f"'fields' names unknown factors {unknown}")
        if not set(d["grouped"]) <= set(d["fields"]):
            raise ValueError(f"'grouped' {d['grouped']} must be among 'fields'")
        for key in ("base", "center"):
            values = d[key]
            if not isinstance(values, dict):
                raise ValueError(f"{key!r} must be an object of factor values")
            for f in ALL_FIELDS:
                v = values.get(f)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise ValueError(f"{key!r}.{f} must be a finite number, got {v!r}")
        return Parameterisation(tuple(d["fields"]), tuple(d["grouped"]), tuple(d["groups"]),
                                tuple(d["base"].items()), tuple(d["center"].items()))
