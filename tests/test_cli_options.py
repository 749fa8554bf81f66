"""Issue 41, item 11: the same option means the same thing in every subcommand (one set of
model / hardware / plan / output groups and defaults), errors name what the user typed, and
every written file is reported."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from cli_run import run

from diffperf.cli import main
from diffperf.cli._common import (
    DEFAULT_INFER_GPU,
    DEFAULT_INFER_MODEL,
    DEFAULT_TRAIN_GPU,
    DEFAULT_TRAIN_MODEL,
    GROUPS,
)

PNG = b"\x89PNG\r\n\x1a\n"

#: A Llama-2-7B-shaped Hugging Face config (sensitivity and attribution refused any config).
CONFIG = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
          "num_key_value_heads": 32, "num_hidden_layers": 32, "intermediate_size": 11008,
          "vocab_size": 32000, "max_position_embeddings": 4096, "hidden_act": "silu"}



def help_text(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


COMMANDS_WITH_A_MODEL = [("train",), ("infer",), ("search", "train"), ("search", "infer"),
                         ("sensitivity",), ("attribution",), ("technology",)]


@pytest.mark.parametrize("command", COMMANDS_WITH_A_MODEL)
def test_every_model_option_takes_a_preset_or_a_config_and_says_its_default(capsys, command):
    text = " ".join(help_text(capsys, *command).split())
    assert "--model MODEL model preset id (diffperf presets) or path to a Hugging Face " \
           "config.json (default" in text
    assert "--infer-model" not in text  # technology's old name: a hidden alias
    for title in ("model", "output"):
        assert f"\n{GROUPS[title]}:" in help_text(capsys, *command)


@pytest.mark.parametrize("command, model, gpu", [
    (("train",), DEFAULT_TRAIN_MODEL, DEFAULT_TRAIN_GPU),
    (("search", "train"), DEFAULT_TRAIN_MODEL, DEFAULT_TRAIN_GPU),
    (("infer",), DEFAULT_INFER_MODEL, DEFAULT_INFER_GPU),
    (("search", "infer"), DEFAULT_INFER_MODEL, DEFAULT_INFER_GPU),
])
def test_training_and_inference_each_have_one_default_model_and_gpu(capsys, command, model,
                                                                     gpu):
    text = " ".join(help_text(capsys, *command).split())
    assert f"(default {model})" in text and gpu in text


def test_infer_runs_without_model_and_gpu_as_search_infer_does(capsys):
    """`infer` required --model and --gpu; `search infer` defaulted them. Now both default to
    Llama-2 70B on H100, and the 1-GPU plan that does not fit says what would."""
    code, out, err = run(capsys, "infer")
    assert code == 0
    assert out.startswith(f"{DEFAULT_INFER_MODEL} on 1 x {DEFAULT_INFER_GPU} (tp=1, pp=1)")
    assert "does not fit in HBM" in err and "diffperf search infer" in err


def test_search_infer_top_and_out_work_as_in_search_train(capsys, tmp_path):
    out = tmp_path / "best.csv"
    code, _, err = run(capsys, "search", "infer", "--model", "llama2-7b", "--max-gpus", "2",
                       "--top", "3", "--out", str(out), "--json")
    assert code == 0
    best, front = pd.read_csv(out), pd.read_csv(tmp_path / "best-pareto.csv")
    assert len(best) == 3 and len(front) >= 3
    assert best["output_tok_s_per_gpu"].is_monotonic_decreasing
    assert f"wrote {out} and {tmp_path / 'best-pareto.csv'}" in err


def test_search_infer_without_a_plan_leaves_the_files_alone(capsys, tmp_path):
    out, pareto = tmp_path / "k.csv", tmp_path / "k-pareto.csv"
    out.write_text("previous\n")
    pareto.write_text("previous pareto\n")
    code, _, err = run(capsys, "search", "infer", "--model", "llama2-7b", "--max-gpus", "2",
                       "--latency", "1e-6", "--out", str(out))
    assert code == 1
    assert out.read_text() == "previous\n" and pareto.read_text() == "previous pareto\n"
    assert "not written" in err


def test_search_infer_checks_its_outputs_before_the_search(capsys, tmp_path):
    (tmp_path / "k-pareto.csv").mkdir()  # the front's file cannot be written
    code, out, err = run(capsys, "search", "infer", "--model", "llama2-7b", "--out",
                         str(tmp_path / "k.csv"))
    assert code == 2 and out == ""
    assert err.startswith("error: --out: cannot write") and len(err.splitlines()) == 1
    code, out, err = run(capsys, "search", "infer", "--out", str(tmp_path / "k.txt"))
    assert code == 2 and err.startswith("error: --out: use a .csv or .parquet file name")


@pytest.mark.parametrize("argv", [
    ["sensitivity", "--workload", "infer", "--top", "3"],
    ["attribution", "--workload", "infer", "--targets", "dgx-h100"],
])
def test_sensitivity_and_attribution_take_a_config_json(capsys, tmp_path, argv):
    """They refused a config.json ('unknown model') that train and infer accept."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    code, out, err = run(capsys, *argv, "--model", str(path))
    assert code == 0, err
    assert str(path) in out
    code, out, err = run(capsys, *argv, "--model", "llama2-7b")
    assert code == 0


def test_technology_model_is_called_model_and_the_old_name_still_works(capsys, tmp_path):
    code, _, err = run(capsys, "technology", "--references-only", "--infer-model", "llama3-8b")
    assert code == 0 and "--infer-model is deprecated: it is --model now" in err
    code, _, err = run(capsys, "technology", "--infer-model", "llama3-8b", "--model",
                       "llama2-7b")
    assert code == 2 and "name two models" in err
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG | {"num_hidden_layers": -1}))
    code, _, err = run(capsys, "technology", "--model", str(path))
    assert code == 2
    assert err.strip() == f"error: {path}: field 'num_hidden_layers' must be a whole number " \
                          f">= 1, got -1"


@pytest.mark.parametrize("argv, named", [
    (["infer", "--model", "llama2-7b", "--gemm-peak-fraction", "2"], "--gemm-peak-fraction"),
    (["train", "--recompute-layers", "-2"], "--recompute-layers"),
    (["train", "--tp", "abc"], "argument --tp: invalid int value: 'abc' (see diffperf train "
                               "--help)"),
    (["search", "infer", "--top", "x"], "argument --top: invalid int value: 'x' (see "
                                        "diffperf search infer --help)"),
])
def test_errors_name_the_option_in_one_line(capsys, argv, named):
    """No internal field (`InferencePlan.gemm_peak_fraction`, `TrainingPlan.recompute_layers`)
    and no usage block: one line naming the option."""
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and named in err
    assert "Plan." not in err and "usage:" not in err


def test_a_config_error_names_the_config_field_not_the_spec_field(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG | {"num_key_value_heads": 3}))
    code, _, err = run(capsys, "infer", "--model", str(path))
    assert code == 2
    assert err.strip() == (f"error: {path}: field 'num_key_value_heads'=3 does not divide "
                           f"field 'num_attention_heads'=32")


@pytest.mark.slow
def test_infer_and_attribution_say_which_plot_they_wrote(capsys, tmp_path):
    roof = tmp_path / "roof.png"
    code, _, err = run(capsys, "infer", "--model", "llama2-7b", "--plot", str(roof))
    assert code == 0 and roof.read_bytes()[:8] == PNG and f"wrote {roof}" in err
    bars = tmp_path / "bars.png"
    code, _, err = run(capsys, "attribution", "--model", "gpt-1.7b", "--gpus", "64",
                       "--global-batch", "64", "--targets", "dgx-h100", "--plot", str(bars))
    assert code == 0 and bars.read_bytes()[:8] == PNG and f"wrote {bars}" in err


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("diffperf 0.")
