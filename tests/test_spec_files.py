"""Issue 40, part 1: GPUs, systems, models and runtimes as JSON files (docs/spec-files.md).

A preset exported with `diffperf presets export` predicts exactly what its id does (the fitted
per-GPU efficiency factors included, through `efficiency_of`); a file with one field changed
predicts what `--set` of that field does; a broken file is one `error:` line naming the file and
the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_run import run

from diffperf import presets

ROOT = Path(__file__).resolve().parents[1]
#: Small jobs, quick to predict.
TRAIN = ["train", "--model", "gpt-1.7b", "--gpus", "16", "--tp", "2", "--pp", "1",
         "--global-batch", "32", "--json"]
INFER = ["infer", "--model", "llama2-7b", "--tp", "1", "--batch", "4", "--input", "512",
         "--output", "64", "--json"]



def predict(capsys, *argv) -> dict:
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    return json.loads(out)


def export(capsys, tmp_path: Path, name: str, **changes) -> Path:
    """`diffperf presets export NAME --out FILE`, then `changes` applied to the file."""
    path = tmp_path / f"{name}.json"
    code, out, err = run(capsys, "presets", "export", name, "--out", str(path))
    assert code == 0 and out == "" and f"wrote {path}" in err
    if changes:
        data = json.loads(path.read_text())
        path.write_text(json.dumps(data | changes))
    return path


# ------------------------------------------------------------------- exported = the id
@pytest.mark.parametrize("gpu", ["h100-sxm5-80gb", "h800-sxm5-80gb"])
def test_an_exported_gpu_predicts_what_its_id_does(capsys, tmp_path, gpu):
    """H100: its own fitted factors; H800: the H100's, by `efficiency_of`. Every number of
    train's and infer's --json is the same, bit for bit."""
    path = export(capsys, tmp_path, gpu)
    assert predict(capsys, *TRAIN, "--gpu", str(path)) == predict(capsys, *TRAIN, "--gpu", gpu)
    assert predict(capsys, *INFER, "--gpu", str(path)) == predict(capsys, *INFER, "--gpu", gpu)
    assert presets.chip_of(str(path)) == "h100-sxm5-80gb"


def test_without_efficiency_of_the_shared_factors_apply_and_a_note_says_so(capsys, tmp_path):
    path = export(capsys, tmp_path, "h100-sxm5-80gb")
    data = json.loads(path.read_text())
    del data["efficiency_of"]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(data))
    code, out, err = run(capsys, *INFER, "--gpu", str(bare))
    assert code == 0
    assert f"note: --gpu {bare}: its GPU names no \"efficiency_of\"" in err
    assert "shared efficiency factors" in err
    assert json.loads(out) != predict(capsys, *INFER, "--gpu", str(path))
    assert str(presets.default_efficiency(str(bare))) == str(presets.default_efficiency().shared())


def test_an_exported_system_predicts_what_its_id_does(capsys, tmp_path):
    """As --system (train), as --gpu (infer: the system's GPU in its network), and holding a
    GPU preset id instead of the nested GPU object."""
    path = export(capsys, tmp_path, "dgx-h100")
    assert isinstance(json.loads(path.read_text())["gpu"], dict)  # self-contained
    by_id = predict(capsys, *TRAIN, "--system", "dgx-h100")
    assert predict(capsys, *TRAIN, "--system", str(path)) == by_id
    assert predict(capsys, *TRAIN, "--gpu", str(path)) == by_id
    assert predict(capsys, *INFER, "--gpu", str(path)) == predict(capsys, *INFER, "--gpu",
                                                                  "dgx-h100")
    named = export(capsys, tmp_path, "dgx-h100", gpu="h100-sxm5-80gb")
    assert predict(capsys, *TRAIN, "--system", str(named)) == by_id


def test_an_exported_runtime_predicts_what_its_id_does(capsys, tmp_path):
    """Host costs and plan defaults (pytorch-eager: no TP overlap) both come from the file."""
    path = export(capsys, tmp_path, "pytorch-eager")
    by_file = predict(capsys, *TRAIN, "--runtime", str(path))
    by_id = predict(capsys, *TRAIN, "--runtime", "pytorch-eager")
    assert by_file.pop("runtime") == by_id.pop("runtime") | {"name": str(path)}
    assert by_file == by_id
    assert by_id["breakdown_s"]["host_wait"] > 0
    assert predict(capsys, *INFER, "--runtime", str(path))["e2e_latency_s"] == \
        predict(capsys, *INFER, "--runtime", "pytorch-eager")["e2e_latency_s"]


@pytest.mark.slow  # the intervals compile their gradients: about 20 s
def test_the_default_runtime_exported_is_the_default(capsys, tmp_path):
    """Its inference intervals too (a runtime other than the calibration set's widens them)."""
    path = export(capsys, tmp_path, presets.DEFAULT_RUNTIME)
    by_file = predict(capsys, *INFER, "--runtime", str(path), "--interval")
    by_id = predict(capsys, *INFER, "--runtime", presets.DEFAULT_RUNTIME, "--interval")
    assert by_file.pop("runtime")["fields"] == by_id.pop("runtime")["fields"]
    assert by_file == by_id and "ttft_interval_s" in by_id


def test_an_exported_model_predicts_what_its_id_does(capsys, tmp_path):
    """Training at its seq_len; inference at its max_context (a 20k prompt on Mistral 7B,
    trained at 4k, serves 32k)."""
    path = export(capsys, tmp_path, "mistral-7b")
    assert presets.is_model_file(path)
    train = [*TRAIN[:2], str(path), *TRAIN[3:]]
    assert predict(capsys, *train) == predict(capsys, *TRAIN[:2], "mistral-7b", *TRAIN[3:])
    argv = ["infer", "--input", "20000", "--output", "16", "--json"]
    assert predict(capsys, *argv, "--model", str(path)) == \
        predict(capsys, *argv, "--model", "mistral-7b")


# ------------------------------------------------------------------- one field changed
def test_a_changed_gpu_field_predicts_what_set_does(capsys, tmp_path):
    hbm = presets.gpu_info("h100-sxm5-80gb")["hbm_bandwidth"]
    path = export(capsys, tmp_path, "h100-sxm5-80gb", hbm_bandwidth=2 * hbm)
    for argv in (TRAIN, INFER):
        by_file = predict(capsys, *argv, "--gpu", str(path))
        by_set = predict(capsys, *argv, "--gpu", "h100-sxm5-80gb", "--set", "hbm_bandwidth=x2")
        by_set.pop("what_if")
        assert by_file == by_set
        assert by_file != predict(capsys, *argv, "--gpu", "h100-sxm5-80gb")


def test_a_changed_system_or_runtime_field_predicts_what_set_does(capsys, tmp_path):
    nvlink = presets.system("dgx-h100").network.nvlink_bandwidth
    path = export(capsys, tmp_path, "dgx-h100", nvlink_bandwidth=float(nvlink) / 4)
    by_set = predict(capsys, *TRAIN, "--system", "dgx-h100", "--set", "nvlink_bandwidth=x0.25")
    by_set.pop("what_if")
    assert predict(capsys, *TRAIN, "--system", str(path)) == by_set
    rt = export(capsys, tmp_path, "pytorch-eager", host_op_time=5e-5)
    by_set = predict(capsys, *TRAIN, "--runtime", "pytorch-eager", "--set", "host_op_time=5e-5")
    by_file = predict(capsys, *TRAIN, "--runtime", str(rt))
    by_set.pop("what_if")
    assert by_file.pop("runtime")["fields"] == by_set.pop("runtime")["fields"]
    assert by_file == by_set


# ------------------------------------------------------------------------ broken files
def _h100() -> dict:
    return presets.preset_file("h100-sxm5-80gb")


BROKEN = {  # (option, file content, field the error names)
    "gpu-unknown-field": ("--gpu", _h100() | {"hbm_bw": 1e12}, "hbm_bw"),
    "gpu-missing-field": ("--gpu", {k: v for k, v in _h100().items() if k != "hbm_bandwidth"},
                          "hbm_bandwidth"),
    "gpu-string": ("--gpu", _h100() | {"hbm_bandwidth": "3.35 TB/s"}, "hbm_bandwidth"),
    "gpu-negative-bandwidth": ("--gpu", _h100() | {"hbm_bandwidth": -3.35e12}, "hbm_bandwidth"),
    "gpu-bool": ("--gpu", _h100() | {"num_sms": True}, "num_sms"),
    "gpu-unknown-efficiency-of": ("--gpu", _h100() | {"efficiency_of": "tpu-v9"},
                                  "efficiency_of"),
    "gpu-unknown-system": ("--gpu", _h100() | {"system": "dgx-x"}, "system"),
    "gpu-bad-precision": ("--gpu", _h100() | {"unsupported_precisions": {"fp9": "no"}},
                          "unsupported_precisions"),
    "gpu-invalid-json": ("--gpu", '{"flops_fp32": 1e12,', "not valid JSON"),
    "system-negative-bandwidth": ("--system", presets.preset_file("dgx-h100")
                                  | {"scaleout_bandwidth": -1}, "scaleout_bandwidth"),
    "system-missing-gpu": ("--system", {k: v for k, v in presets.preset_file("dgx-h100").items()
                                        if k != "gpu"}, "gpu"),
    "system-bad-nested-gpu": ("--system", presets.preset_file("dgx-h100")
                              | {"gpu": _h100() | {"num_sms": 131.5}}, "num_sms"),
    "system-unknown-gpu": ("--system", presets.preset_file("dgx-h100") | {"gpu": "h100"}, "gpu"),
    "model-unknown-field": ("--model", presets.preset_file("llama2-7b") | {"layer": 2}, "layer"),
    "model-missing-field": ("--model", {k: v for k, v in presets.preset_file("llama2-7b").items()
                                        if k != "vocab"}, "vocab"),
    "model-string": ("--model", presets.preset_file("llama2-7b") | {"heads": "32"}, "heads"),
    "model-out-of-range": ("--model", presets.preset_file("llama2-7b") | {"layers": 0},
                           "layers"),
    "model-invalid-json": ("--model", '{"layers": 32', "not valid JSON"),
    "runtime-unknown-field": ("--runtime", {"host_op_tim": 1e-5}, "host_op_tim"),
    "runtime-string": ("--runtime", {"host_op_time": "fast"}, "host_op_time"),
    "runtime-negative": ("--runtime", {"host_op_time": -1e-5}, "host_op_time"),
    "runtime-plan-default": ("--runtime", {"plan_defaults": {"overlap_tpp": 0}}, "overlap_tpp"),
    "runtime-invalid-json": ("--runtime", "{", "not valid JSON"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_file_is_one_line_naming_the_file_and_the_field(capsys, tmp_path, case):
    option, content, field = BROKEN[case]
    path = tmp_path / "spec.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    command = "infer" if option in ("--gpu", "--model", "--runtime") else "train"
    code, out, err = run(capsys, command, option, str(path))
    lines = err.strip().splitlines()
    assert code == 2 and out == "", err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert str(path) in lines[0] and field in lines[0], lines[0]


def test_a_missing_file_and_an_unknown_runtime_are_named(capsys, tmp_path):
    missing = tmp_path / "nope.json"
    code, _, err = run(capsys, "infer", "--gpu", str(missing))
    assert code == 2 and f"{missing} does not exist" in err
    code, _, err = run(capsys, "infer", "--runtime", "no-such-runtime")
    assert code == 2 and "--runtime: unknown runtime 'no-such-runtime'" in err


def test_a_gpu_file_without_a_system_needs_one(capsys, tmp_path):
    """Its network comes from the `system` it names, else from --system."""
    data = _h100()
    del data["system"]
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(data))
    code, _, err = run(capsys, *INFER, "--gpu", str(path))
    assert code == 2 and "names no 'system'" in err and str(path) in err
    assert predict(capsys, *TRAIN, "--gpu", str(path), "--system", "dgx-h100") == \
        predict(capsys, *TRAIN, "--gpu", "h100-sxm5-80gb", "--system", "dgx-h100")


def test_unsupported_precisions_come_from_the_file(capsys, tmp_path):
    """A V100 file refuses bf16 and defaults to fp16, as the preset does."""
    path = export(capsys, tmp_path, "v100-sxm2-32gb")
    code, _, err = run(capsys, *TRAIN, "--gpu", str(path), "--precision", "bf16")
    assert code == 2 and "--precision bf16: V100 has no bf16" in err
    code, out, _ = run(capsys, *TRAIN[:-1], "--gpu", str(path))
    assert code == 0 and out.splitlines()[0].endswith(" fp16)")
    assert presets.default_precision(str(path)) == "fp16"


# ---------------------------------------------------------------------------- export
def test_export_writes_to_stdout_what_out_writes(capsys, tmp_path):
    path = export(capsys, tmp_path, "llama3-70b")
    code, out, _ = run(capsys, "presets", "export", "llama3-70b")
    assert code == 0 and out == path.read_text()
    assert json.loads(out) == presets.preset_file("llama3-70b")
    code, out, _ = run(capsys, "presets", "export", "h100")  # a prefix names the GPU
    assert json.loads(out)["efficiency_of"] == "h100-sxm5-80gb"
    code, _, err = run(capsys, "presets", "export", "tpu-v9")
    assert code == 2 and "unknown preset 'tpu-v9'" in err


def test_presets_still_lists(capsys):
    code, out, _ = run(capsys, "presets")
    assert code == 0 and out.startswith("gpus: ") and "runtimes: " in out
    listed = json.loads(run(capsys, "presets", "--json")[1])
    assert listed["gpus"] == presets.gpu_names() and listed["models"] == presets.model_names()


def test_every_preset_round_trips_through_its_file(tmp_path):
    """Each preset's file loads to the spec its id gives (the Python API)."""
    for kind, names, load, from_file in (
            ("gpu", presets.gpu_names(), presets.gpu, presets.gpu_from_file),
            ("system", presets.system_names(), presets.system, presets.system_from_file),
            ("model", presets.model_names(), presets.model, presets.model_from_file),
            ("runtime", presets.runtime_names(), presets.runtime, presets.runtime_from_file)):
        for name in names:
            path = tmp_path / f"{kind}-{name}.json"
            path.write_text(json.dumps(presets.preset_file(name)))
            assert str(from_file(path)) == str(load(name)), name
            if kind == "gpu":
                assert presets.chip_of(str(path)) == presets.chip_of(name)
                assert str(presets.system(str(path))) == str(presets.system(name))


def test_the_documented_examples_load(tmp_path):
    """Every JSON example of docs/spec-files.md is a valid file of its kind."""
    text = (ROOT / "docs" / "spec-files.md").read_text()
    examples = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", text, flags=re.S)]
    assert len(examples) == 4
    for i, data in enumerate(examples):
        path = tmp_path / f"example{i}.json"
        path.write_text(json.dumps(data))
        if "layers" in data:
            presets.model_from_file(path)
        elif "flops_bf16" in data or "gpu" in data:
            presets.system_from_file(path)
        else:
            presets.runtime_from_file(path)
