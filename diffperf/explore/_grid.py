"""Sweep grids: the Cartesian product of value lists, decoded on the device from flat indices.

A grid of 10^8 points is never materialised: a chunk of flat indices `start + arange(chunk)` is
turned into per-axis values inside the jitted evaluation by mixed-radix decoding (the last axis
varies fastest), so the host only ever holds the value lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

#: Largest grid (flat indices are int32 on the device).
MAX_POINTS = 2**31 - 1


class Grid:
    """Product of named value lists.

    **Arguments:**

    - `axes`: mapping from axis name to a non-empty sequence of numbers (categorical values as
      integer codes), in order (last varies fastest).
    """

    def __init__(self, axes: Mapping[str, Sequence[float]]):
        if not axes:
            raise ValueError("a grid needs at least one axis")
        self.axes: dict[str, np.ndarray] = {}
        for name, values in axes.items():
            v = np.asarray(values, dtype=np.float64).ravel()
            if v.size == 0:
                raise ValueError(f"grid axis {name!r} has no values")
            if not np.all(np.isfinite(v)):
                raise ValueError(f"grid axis {name!r} has a non-finite value: {list(values)}")
            self.axes[name] = v
        self.size = int(np.prod([v.size for v in self.axes.values()], dtype=np.float64))
        if self.size > MAX_POINTS:
            raise ValueError(f"grid has {self.size:,} points; at most {MAX_POINTS:,} are supported "
                             f"per grid (split it along one axis)")

    @property
    def names(self) -> list[str]:
        return list(self.axes)

    def _radices(self) -> list[int]:
        return [v.size for v in self.axes.values()]

    def decode(self, flat: jax.Array) -> dict[str, jax.Array]:
        """Axis values of flat indices (works on traced int32 arrays inside jit)."""
        out, rest = {}, flat
        for name, radix in reversed(list(zip(self.names, self._radices()))):
            digit = rest % radix
            rest = rest // radix
            table = jnp.asarray(self.axes[name], dtype=jnp.result_type(float))
            out[name] = table[digit]
        return {n: out[n] for n in self.names}

    def decode_host(self, flat, names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Axis values of flat indices, with NumPy on the host. With `names` (a prefix of the
        axes), `flat` indexes the product of those axes only."""
        names = self.names if names is None else list(names)
        if not names:
            return {}
        flat = np.asarray(flat, dtype=np.int64)
        digits = np.unravel_index(flat, [self.axes[n].size for n in names])
        return {n: self.axes[n][d] for n, d in zip(names, digits)}

    def split(self, max_inner: int) -> tuple[list[str], list[str]]:
        """Split the axes into (outer, inner): the inner ones are the longest suffix whose product
        is at most `max_inner` (at least the last axis)."""
        names, inner, size = self.names, [], 1
        for name in reversed(names):
            n = self.axes[name].size
            if inner and size * n > max_inner:
                break
            inner.insert(0, name)
            size *= n
        return names[:len(names) - len(inner)], inner

    def product(self, names: list[str]) -> dict[str, np.ndarray]:
        """All combinations of the named axes as columns (last varies fastest)."""
        if not names:
            return {}
        mesh = np.meshgrid(*[self.axes[n] for n in names], indexing="ij")
        return {n: m.ravel() for n, m in zip(names, mesh)}

    def __repr__(self) -> str:
        dims = " x ".join(f"{n}[{v.size}]" for n, v in self.axes.items())
        return f"Grid({dims} = {self.size:,} points)"
