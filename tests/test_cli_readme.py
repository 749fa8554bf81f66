"""Issue 41, item 12: what the README shows must hold: every shipped preset is listed, and every
file its commands read is shipped (`predict --data configs.csv` named a file that was not)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from diffperf import presets

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _commands() -> list[list[str]]:
    """The `diffperf ...` lines of the README's bash blocks, split into words."""
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    text = "\n".join(blocks).replace("\\\n", " ")
    return [shlex.split(line.split("#")[0]) for line in text.splitlines()
            if line.strip().startswith("diffperf ")]


def test_the_readme_lists_every_preset():
    for name in presets.model_names() + presets.gpu_names() + presets.system_names():
        assert f"`{name}`" in README, name


def test_every_file_a_readme_command_reads_is_shipped():
    """Files it reads, that is: `mine.csv` stands for the reader's own measurements."""
    read = [c[i + 1] for c in _commands() for i, w in enumerate(c[:-1])
            if w in ("--data", "--efficiency")]
    assert read
    for path in read:
        assert path.startswith("mine") or (ROOT / path).is_file(), path


def test_the_example_configurations_are_predicted(capsys):
    from diffperf.cli import main
    assert main(["predict", "--data", str(ROOT / "examples" / "configs.csv"), "--json"]) == 0
    rows = __import__("json").loads(capsys.readouterr().out)["rows"]
    assert [r["status"].split(" (")[0] for r in rows] == [
        "ok", "does not fit in HBM", "ok", "ok"]
