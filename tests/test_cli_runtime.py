"""Issue 36, item 3 (command line): `--runtime` on the commands that predict, its plan defaults
(explicit flags win), the runtime named in every report and in `--json`, `diffperf presets`
listing runtimes, and `--set` reaching runtime fields."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cli_run import run

import diffperf as dp
from diffperf import presets
from diffperf.design._sensitivity import best_training_plan
from diffperf.explore._what_if import parse_override
from diffperf.specs._hardware import Accelerator, Network
from diffperf.specs._runtime import Runtime
from diffperf.training._step import predict_training

#: A small training job whose step is short enough for the host to matter.
SMALL = ["train", "--model", "gpt-1.7b", "--gpu", "a100-sxm4-80gb", "--gpus", "8", "--tp", "2",
         "--pp", "1", "--global-batch", "64"]
EAGER = "megatron-deepspeed-2023"  # a runtime with host costs and plan defaults



def train_json(capsys, *extra) -> dict:
    code, out, err = run(capsys, *SMALL, *extra, "--json")
    assert code == 0, err
    return json.loads(out)


def test_the_default_runtime_predicts_what_no_runtime_does(capsys):
    """Naming the default runtime changes nothing, and both equal the library's prediction
    without a runtime (`runtime=None`), bit for bit."""
    plain = train_json(capsys)
    named = train_json(capsys, "--runtime", presets.DEFAULT_RUNTIME)
    assert plain["runtime"]["name"] == named["runtime"]["name"] == presets.DEFAULT_RUNTIME
    assert not plain["runtime"]["given"] and named["runtime"]["given"]
    for s in (plain, named):
        s.pop("runtime")
    assert plain == named
    plan = dp.TrainingPlan(tp=2, pp=1, dp=4, micro_batch=1, global_batch=64, vp=1,
                           sequence_parallel=1, recompute="selective", zero=1)
    ref = predict_training(dp.model("gpt-1.7b"), dp.system("a100-sxm4-80gb"), plan,
                           presets.default_efficiency().for_gpu("a100-sxm4-80gb"))
    assert plain["step_time_s"] == float(ref.step_time)
    assert plain["breakdown_s"]["host_wait"] == 0.0


def test_an_eager_runtime_is_slower_and_its_header_names_it_and_its_plan_defaults(capsys):
    base = train_json(capsys)
    eager = train_json(capsys, "--runtime", EAGER)
    assert eager["step_time_s"] > base["step_time_s"]
    assert eager["breakdown_s"]["host_wait"] > 0
    assert sum(eager["breakdown_s"].values()) == pytest.approx(eager["step_time_s"], rel=1e-5)
    defaults = presets.runtime_plan_defaults(EAGER)
    assert defaults and eager["runtime"]["plan_defaults_applied"] == defaults
    assert eager["runtime"]["fields"]["host_op_time"] == pytest.approx(
        float(presets.runtime(EAGER).host_op_time))
    code, out, _ = run(capsys, *SMALL, "--runtime", EAGER)
    assert code == 0
    header = out.splitlines()[1]
    assert header.startswith(f"  runtime: {EAGER} (")
    assert "plan defaults applied: " + ", ".join(f"{k}={v:g}" for k, v in defaults.items()) \
        in header
    host = next(line for line in out.splitlines() if line.strip().startswith("host_wait"))
    share = float(host.split()[3])
    assert share == pytest.approx(100 * eager["breakdown_s"]["host_wait"]
                                  / eager["step_time_s"], abs=0.051)
    # the default runtime's table has no host row (its host never binds): today's output
    code, out, _ = run(capsys, *SMALL)
    assert "host_wait" not in out and f"runtime: {presets.DEFAULT_RUNTIME} (the default" in out


def test_an_explicit_flag_wins_over_the_runtimes_plan_default(capsys):
    assert presets.runtime_plan_defaults(EAGER)["overlap_tp"] == 0
    applied = train_json(capsys, "--runtime", EAGER)
    kept = train_json(capsys, "--runtime", EAGER, "--overlap-tp")
    assert "overlap_tp" not in kept["runtime"]["plan_defaults_applied"]
    assert kept["runtime"]["plan_defaults_overridden"] == {"overlap_tp": "--overlap-tp"}
    # TP overlap hides TP communication the runtime's default exposes
    assert (kept["breakdown_s"]["tp_comm_exposed"]
            < applied["breakdown_s"]["tp_comm_exposed"])
    # without --runtime, --no-overlap-tp gives the plan the runtime's default gives
    same = train_json(capsys, "--no-overlap-tp", "--no-overlap-tp-backward")
    assert same["breakdown_s"]["tp_comm_exposed"] == applied["breakdown_s"]["tp_comm_exposed"]
    code, out, _ = run(capsys, *SMALL, "--runtime", EAGER, "--overlap-tp")
    assert "plan defaults replaced by the options given: overlap_tp (--overlap-tp)" in out


@pytest.mark.parametrize("command", [SMALL, ["infer"], ["search", "train"],
                                     ["search", "infer"], ["sensitivity"], ["attribution"],
                                     ["technology"], ["codesign"]])
def test_an_unknown_runtime_is_one_line_naming_the_flag_and_the_known_ones(capsys, command):
    code, out, err = run(capsys, *command, "--runtime", "no-such-runtime")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "--runtime" in err and "no-such-runtime" in err
    for name in presets.runtime_names():
        assert name in err


def test_set_reaches_runtime_fields(capsys):
    base = train_json(capsys)
    slow = train_json(capsys, "--set", "host_op_time=2e-4")
    assert slow["step_time_s"] > base["step_time_s"]
    assert slow["breakdown_s"]["host_wait"] > 0
    assert slow["runtime"]["set"] == ["host_op_time=0.0002"]
    assert slow["runtime"]["fields"]["host_op_time"] == pytest.approx(2e-4)
    w = slow["what_if"]
    assert w["preset"]["step_time_s"] == pytest.approx(base["step_time_s"], rel=1e-6)
    assert w["changes"] == ["host_op_time 0 -> 0.0002 s"]
    # a multiple of the runtime preset's value
    eager = train_json(capsys, "--runtime", EAGER)
    doubled = train_json(capsys, "--runtime", EAGER, "--set", "host_op_time=x2")
    assert doubled["step_time_s"] > eager["step_time_s"]
    assert doubled["what_if"]["preset"]["step_time_s"] == pytest.approx(eager["step_time_s"])
    code, out, _ = run(capsys, *SMALL, "--set", "runtime.host_op_time=2e-4")
    assert code == 0 and "[what-if host_op_time=0.0002]" in out.splitlines()[0]


def test_set_runtime_errors_are_clear(capsys):
    code, _, err = run(capsys, *SMALL, "--set", "host_op_tim=1")
    assert code == 2 and "unknown hardware field 'host_op_tim'" in err
    assert "runtime: host_op_time" in err
    code, _, err = run(capsys, *SMALL, "--set", "train_graph=2")
    assert code == 2 and "train_graph" in err and len(err.strip().splitlines()) == 1


def test_no_runtime_field_shares_a_name_with_a_hardware_field():
    hardware = {f.name for c in (Accelerator, Network) for f in dataclasses.fields(c)}
    runtime = {f.name for f in dataclasses.fields(Runtime)}
    assert not hardware & runtime
    for name in runtime:
        assert parse_override(f"{name}=1").part == "runtime"


def test_presets_lists_every_runtime(capsys):
    code, out, _ = run(capsys, "presets")
    assert code == 0
    listed = next(line for line in out.splitlines() if line.startswith("runtimes: "))
    assert listed == "runtimes: " + ", ".join(presets.runtime_names())
    for name in presets.runtime_names():
        assert f"\n  {name}" in out
    code, out, _ = run(capsys, "presets", "--json")
    assert code == 0
    data = json.loads(out)
    assert [r["name"] for r in data["runtimes"]] == presets.runtime_names()
    assert data["default_runtime"] == presets.DEFAULT_RUNTIME
    eager = next(r for r in data["runtimes"] if r["name"] == EAGER)
    assert eager["plan_defaults"] == presets.runtime_plan_defaults(EAGER)
    assert set(eager["fields"]) == {f.name for f in dataclasses.fields(Runtime)}
    assert "gpus" in data and "models" in data


def test_infer_names_its_runtime_and_the_host_share(capsys):
    argv = ["infer", "--model", "llama2-7b", "--gpu", "h100-sxm5-80gb", "--batch", "8",
            "--input", "256", "--output", "64"]
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    plain = json.loads(out)
    assert plain["runtime"]["name"] == presets.DEFAULT_RUNTIME
    assert plain["decode_s"]["host"] == 0.0
    eager = next((n for n in presets.runtime_names()
                  if presets.runtime_info(n).get("host_step_time", 0) > 0
                  or presets.runtime_info(n).get("host_op_time", 0) > 0), None)
    assert eager is not None
    code, out, _ = run(capsys, *argv, "--runtime", eager, "--json")
    s = json.loads(out)
    assert code == 0 and s["runtime"]["name"] == eager
    assert s["e2e_latency_s"] > plain["e2e_latency_s"]
    code, out, _ = run(capsys, *argv, "--runtime", eager)
    lines = out.splitlines()
    assert lines[1].startswith(f"  runtime: {eager} (")
    assert any(line.strip().startswith("host-bound") for line in lines)
    # the decode-graph what-if removes launch cost from decode
    code, out, _ = run(capsys, *argv, "--set", "decode_graph=1", "--json")
    assert code == 0 and json.loads(out)["tpot_s"] < plain["tpot_s"]


def test_search_train_takes_the_runtime_and_its_plan_defaults(capsys, monkeypatch):
    """The CLI hands the runtime and its plan defaults to the search (the search itself is
    stubbed: compiling a sweep takes half a minute), the default grid searches only the
    runtime's value of an axis it fixes, and the plans carry its other defaults."""
    import pandas as pd

    from diffperf.cli import _search
    from diffperf.explore import default_training_grid, plan_from_values

    seen = {}

    def search(model, system, gpus, global_batch, **kw):
        seen.update(kw)
        return {"evaluated": 0, "feasible": 0, "seconds": 0.0, "reasons": {},
                "top": pd.DataFrame(), "pareto": pd.DataFrame(), "least_memory": None}

    monkeypatch.setattr(_search, "search_training", search)
    argv = ["search", "train", "--model", "gpt-1.7b", "--gpus", "8", "--global-batch", "16"]
    code, out, _ = run(capsys, *argv, "--runtime", EAGER, "--json")
    assert code == 1  # no plan (stubbed)
    defaults = presets.runtime_plan_defaults(EAGER)
    assert seen["plan_defaults"] == defaults
    assert float(seen["runtime"].host_op_time) == pytest.approx(
        float(presets.runtime(EAGER).host_op_time))
    assert seen["grid"].axes["overlap_tp"].tolist() == [defaults["overlap_tp"]]
    assert json.loads(out)["runtime"]["name"] == EAGER
    code, out, _ = run(capsys, *argv, "--json")
    assert seen["plan_defaults"] == {} and len(seen["grid"].axes["overlap_tp"]) == 2
    model = dp.model("gpt-1.7b")
    assert len(default_training_grid(model, 8, 16).axes["overlap_tp"]) == 2
    plan = plan_from_values({"tp": 2.0}, 8, 16, defaults)
    assert float(plan.overlap_tp) == float(plan.overlap_tp_backward) == 0.0
    assert float(plan_from_values({"tp": 2.0}, 8, 16).overlap_tp_backward) == 1.0


@pytest.mark.slow
def test_design_studies_keep_the_runtimes_zero_default():
    """`megatron-lm-2022` has no distributed optimizer (zero 0): the studies' own choice
    (zero 1) must not replace it."""
    plan = best_training_plan(dp.model("llama2-7b"), dp.system("dgx-a100"), 16, 64,
                              plan_defaults=presets.runtime_plan_defaults("megatron-lm-2022"))
    assert float(plan.zero) == 0.0 and float(plan.flash_attention) == 0.0


def test_infer_names_the_grace_hosts_slower_cpu(capsys):
    """On GB200 the report says the runtime's host times are 2.75x (the preset's
    `host_time_factor`) and `--json` carries it; `--set host_time_factor=1` (an x86 host) makes
    a host-bound TensorRT-LLM decode of 512 sequences faster; on B200 no such line."""
    args = ("infer", "--model", "llama3-8b", "--runtime", "trtllm", "--batch", "512",
            "--input", "128", "--output", "64")
    code, text, err = run(capsys, *args, "--gpu", "gb200")
    assert code == 0, err
    assert "host CPU: the runtime's host times x2.75" in text
    _, grace, _ = run(capsys, *args, "--gpu", "gb200", "--json")
    _, x86, _ = run(capsys, *args, "--gpu", "gb200", "--set", "host_time_factor=1", "--json")
    grace, x86 = json.loads(grace), json.loads(x86)
    assert grace["host_time_factor"] == 2.75 and x86["host_time_factor"] == 1.0
    assert x86["tpot_s"] < grace["tpot_s"]
    _, plain, _ = run(capsys, *args, "--gpu", "b200")
    assert "host CPU" not in plain
    # the default runtime has no host times: the factor changes nothing, and is not named
    _, default, _ = run(capsys, "infer", "--model", "llama3-8b", "--gpu", "gb200")
    assert "host CPU" not in default
