"""`import diffperf` and one `diffperf train` load neither pandas, matplotlib nor optax (they
cost 0.1-0.3 s each of a prediction's second or two; docs/speed.md): each is imported inside the
function that builds a table, draws or fits (tests/test_import_layers.py allows exactly these)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("pandas", "matplotlib", "optax")

_CHECK = """
import json, sys
{body}
print(json.dumps([m for m in {heavy!r} if m in sys.modules]))
"""


def _loaded(body: str, tmp_path) -> list[str]:
    env = dict(os.environ, DIFFPERF_COMPILATION_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", _CHECK.format(body=body, heavy=HEAVY)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_diffperf_and_the_command_line_load_no_heavy_dependency(tmp_path):
    assert _loaded("import diffperf\nimport diffperf.cli\n"
                   "diffperf.cli.build_parser().parse_args(['train'])", tmp_path) == []


def test_import_diffperf_and_its_command_line_entry_load_no_jax(tmp_path):
    """The entry point hands a command to a running daemon before anything imports JAX
    (`diffperf.cli.main`, docs/cli.md#daemon)."""
    body = ("import sys\nimport diffperf\nimport diffperf.cli\n"
            "assert 'jax' not in sys.modules and 'equinox' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('jax', 'equinox')))")
    assert _loaded(body, tmp_path) == []


def test_the_lazy_public_names_stay_importable():
    """`diffperf/__init__.py` imports the sweeps, searches and plots on first use; they are
    still names of the package, listed by dir() and __all__."""
    import diffperf
    from diffperf import Grid, roofline_plot  # noqa: F401
    assert set(diffperf.__all__) <= set(dir(diffperf))
    assert all(callable(getattr(diffperf, name)) for name in diffperf.__all__
               if not name.isupper())
    with pytest.raises(AttributeError):
        diffperf.no_such_name  # noqa: B018


@pytest.mark.slow
def test_a_training_prediction_loads_no_heavy_dependency(tmp_path):
    body = ("import contextlib, io\nimport diffperf.cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert diffperf.cli.main(['train', '--json']) == 0")
    assert _loaded(body, tmp_path) == []
