"""Issue 41's silent wrong answers and lost data at the command line: each of these passed a
bad value through (or overwrote a file) before it was fixed."""

from __future__ import annotations

import pytest

from diffperf.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("value", ["-1", "0", "1.5", "1e30"])
def test_search_infer_refuses_a_gemm_peak_fraction_outside_0_1(capsys, value):
    """It used to take -1 and report a best plan with a 3x shorter TTFT."""
    code, out, err = run(capsys, "search", "infer", "--model", "llama2-7b", "--gpu", "h100",
                         f"--gemm-peak-fraction={value}")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"error: --gemm-peak-fraction must lie in (0, 1], got "
                                        f"{float(value):g}"]


def test_infer_names_the_option_not_the_internal_field(capsys):
    code, _, err = run(capsys, "infer", "--model", "llama2-7b", "--gpu", "h100",
                       "--gemm-peak-fraction", "1.5")
    assert code == 2 and "--gemm-peak-fraction" in err and "InferencePlan" not in err


@pytest.mark.parametrize("argv, option", [
    (["search", "infer", "--model", "llama2-7b", "--gpu", "h100", "--prefill-tokens", "-1"],
     "--prefill-tokens must be >= 0"),
    (["infer", "--model", "llama2-7b", "--gpu", "h100", "--prefill-tokens", "100000000"],
     "--prefill-tokens must be <= 16777216"),
    (["train", "--model", "mixtral-8x7b", "--gpu", "h100", "--gpus", "8", "--tp", "8",
      "--ep", "8", "--expert-tp", "100000000"], "--expert-tp must be <= 16777216"),
])
def test_counts_are_bounded_like_the_others(capsys, argv, option):
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.startswith(f"error: {option}") and len(err.splitlines()) == 1


def test_a_search_without_a_feasible_plan_leaves_existing_files_alone(capsys, tmp_path):
    """7 GPUs divide no plan of this model: the run finds nothing and must not overwrite the
    tables a previous run wrote (it used to leave a lone newline in both)."""
    out = tmp_path / "k.csv"
    pareto = tmp_path / "k-pareto.csv"
    out.write_text("previous,run\n1,2\n")
    pareto.write_text("previous,pareto\n3,4\n")
    code, _, err = run(capsys, "search", "train", "--model", "gpt-1.7b", "--gpus", "7",
                       "--global-batch", "32", "--out", str(out))
    assert code == 1
    assert out.read_text() == "previous,run\n1,2\n"
    assert pareto.read_text() == "previous,pareto\n3,4\n"
    assert "not written" in err


@pytest.mark.parametrize("target", ["out", "pareto"])
def test_an_unwritable_output_fails_before_the_search(capsys, tmp_path, target):
    """The search's tables are checked writable before the search runs (a read-only file
    system: /proc refuses a new file even to root). A path that cannot be written fails at once
    with the option named, instead of after the work with the result lost."""
    out = "/proc/diffperf-k.csv" if target == "out" else str(tmp_path / "k.csv")
    if target == "pareto":  # the Pareto table's name taken by a directory
        (tmp_path / "k-pareto.csv").mkdir()
    code, stdout, err = run(capsys, "search", "train", "--model", "gpt-1.7b", "--gpus", "8",
                            "--global-batch", "32", "--out", out)
    assert code == 2 and stdout == ""
    # root is told "cannot write" (its access check passes, the probe fails); another user is
    # stopped one check earlier, at the directory
    assert err.startswith("error: --out: ") and len(err.splitlines()) == 1
    assert "evaluated" not in err


def test_the_writability_check_changes_nothing(capsys, tmp_path):
    """Probing an output for writability neither creates a file nor touches an existing one."""
    from diffperf.internal import check_writable
    new, old = tmp_path / "new.csv", tmp_path / "old.csv"
    old.write_text("keep\n")
    check_writable("--out", new)
    check_writable("--out", old)
    assert not new.exists() and old.read_text() == "keep\n"


# Issue 41, item 8: work sizes and counts without a cap ran for minutes, allocated tens of GB or
# ended in a JAX traceback.
@pytest.mark.parametrize("argv, error", [
    (["codesign", "--steps", "2147483648"],
     "--steps must be <= 100,000 (the most `diffperf codesign` accepts), got 2,147,483,648"),
    (["codesign", "--starts", "2147483648"],
     "--starts must be <= 4,096 (the most `diffperf codesign` accepts), got 2,147,483,648"),
    (["codesign", "--starts", "100000000"],
     "--starts must be <= 4,096 (the most `diffperf codesign` accepts), got 100,000,000"),
    (["codesign", "--steps", "10000", "--starts", "4096"],
     "--steps x --starts must be <= 10,000,000 (about a minute and 1 GB), got 10000 x 4096 = "
     "40,960,000"),
    (["bench", "--n", "2147483648"],
     "--n must be <= 10,000,000 (the most `diffperf bench` accepts), got 2,147,483,648"),
    (["calibrate", "--out", "fit.json", "--lbfgs-steps", "2147483648"],
     "--lbfgs-steps must be <= 100,000 (the most `diffperf calibrate` accepts)"),
    (["calibrate", "--out", "fit.json", "--folds", "2147483648"],
     "--folds must be <= 16777216 (2^24), got 2147483648"),
    (["calibrate", "--out", "fit.json", "--folds", "1"], "--folds must be >= 2"),
    (["search", "train", "--top", "2147483648"],
     "--top must be <= 16777216 (2^24), got 2147483648"),
    (["train", "--recompute-layers", "-1"], "--recompute-layers must be >= 0, got -1"),
    (["train", "--offload-layers", "100000000"], "--offload-layers must be <= 16777216"),
    (["search", "train", "--offload-layers", "0", "--offload-layers", "-3"],
     "--offload-layers must be >= 0, got -3"),
])
def test_work_sizes_and_counts_have_a_cap(capsys, argv, error):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {error}")


@pytest.mark.parametrize("command", [["train"], ["infer", "--model", "llama2-7b"],
                                     ["search", "infer", "--model", "llama2-7b"],
                                     ["sensitivity"]])
@pytest.mark.parametrize("item, shown", [
    ("nvlink_domain=100000000", "nvlink_domain must be <= 16777216 (2^24: larger counts are not "
                                "exact in float32), got 1e+08"),
    ("num_sms=2147483648", "num_sms must be <= 16777216"),
    ("num_sms=x1e9", "num_sms must be <= 16777216 (2^24: larger counts are not exact in "
                     "float32), got 1."),
])
def test_set_counts_have_the_2_24_cap(capsys, command, item, shown):
    """`--set nvlink_domain=...` and `num_sms=...` (a value or a multiple) are counts the model
    holds in float32, like --nvlink-domain: they used to run and print a what-if."""
    code, out, err = run(capsys, *command, "--set", item)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: --set ") and shown in err
