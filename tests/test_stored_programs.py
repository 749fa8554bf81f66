"""`diffperf._stored_programs`: a stored program is loaded instead of traced, gives the numbers
the plain jit gives, is keyed by everything that changes its trace, and anything unexpected falls
back to tracing."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffperf import _stored_programs as sp


class Box(eqx.Module):
    x: jax.Array
    scale: float = eqx.field(static=True, default=2.0)


traces: list[int] = []


def f(box, y):
    traces.append(1)
    return {"out": jnp.exp(box.x) * box.scale / y, "sum": jnp.sum(box.x + y)}


@pytest.fixture
def directory(tmp_path):
    sp.set_directory(tmp_path)
    traces.clear()
    yield tmp_path
    sp.set_directory(None)


def _args(n=3, scale=2.0):
    return Box(jnp.linspace(0.1, 1.3, n, dtype=jnp.float32), scale), jnp.float32(0.7)


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_without_a_directory_it_is_jax_jit(tmp_path):
    sp.set_directory(None)
    assert _same(sp.stored_jit(f)(*_args()), jax.jit(f)(*_args()))
    assert not list(tmp_path.iterdir())


def test_a_later_process_loads_the_program_instead_of_tracing(directory):
    expected = jax.jit(f)(*_args())
    traces.clear()
    assert _same(sp.stored_jit(f)(*_args()), expected)
    assert len(traces) == 1 and len(list(directory.glob("f-*.program"))) == 1
    later = sp.stored_jit(f)  # a new process: nothing loaded yet
    assert _same(later(*_args()), expected)
    assert _same(later(*_args()), expected)
    assert len(traces) == 1  # loaded twice (from disk, then from memory), never traced


def test_the_key_follows_shapes_and_static_fields(directory):
    g = sp.stored_jit(f)
    for args in (_args(), _args(n=4), _args(scale=3.0), _args()):
        assert _same(g(*args), jax.jit(f)(*args))
    assert len(list(directory.glob("f-*.program"))) == 3


def test_filter_makes_python_numbers_constants(directory):
    g = sp.stored_jit(f, filter=True)
    box, _ = _args()
    for y in (0.5, 0.25, 0.5):
        assert _same(g(box, y), eqx.filter_jit(f)(box, y))
    assert len(list(directory.glob("f-*.program"))) == 2


def test_an_unreadable_program_is_traced_again(directory):
    sp.stored_jit(f)(*_args())
    (path,) = directory.glob("f-*.program")
    path.write_bytes(b"garbage")
    expected = jax.jit(f)(*_args())
    traces.clear()
    assert _same(sp.stored_jit(f)(*_args()), expected)
    assert len(traces) == 1 and path.read_bytes() != b"garbage"  # traced and rewritten


def test_old_programs_are_pruned(directory, monkeypatch):
    monkeypatch.setattr(sp, "KEEP", 2)
    g = sp.stored_jit(f)
    for n in (2, 3, 4, 5):
        g(*_args(n=n))
    assert len(list(directory.glob("f-*.program"))) == 2
