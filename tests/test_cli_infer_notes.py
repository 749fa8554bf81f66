"""`diffperf infer`: the KV-only batch limit next to max batch, precision combinations that
would mislabel the math, and the notes on what a prediction rests on."""

from __future__ import annotations

import json

from diffperf.cli import main


def _json(capsys, *argv):
    code = main(["infer", *argv, "--json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == 0 else None), out.err


def test_kv_only_max_batch_by_hand(capsys):
    """Llama 3 70B, TP 8 on H100, 2,048 + 256 tokens: KV per sequence and GPU = 2 x 80 layers
    x 1 KV head x 128 x 2 B x 2,304 = 94.37 MB; the H100's 81,559 MiB = 85.52 GB, so (85.52 -
    17.64 weights - 2.0 workspace) GB / 94.37 MB = 698 sequences, more than `max_batch`, which
    also holds every prompt's prefill activations."""
    code, s, _ = _json(capsys, "--model", "llama3-70b", "--gpu", "h100-sxm5-80gb", "--tp", "8",
                       "--input", "2048", "--output", "256")
    assert code == 0
    kv = 2 * 80 * 1 * 128 * 2 * 2304
    free = 81559 * 2**20 - s["memory_gb"]["weights"] * 1e9 - s["memory_gb"]["workspace"] * 1e9
    assert s["max_batch_kv_only"] == int(free // kv) == 698
    assert s["max_batch"] < s["max_batch_kv_only"]


def test_activations_narrower_than_float_weights_are_refused(capsys):
    code, _, err = _json(capsys, "--model", "llama3-8b", "--gpu", "h100-sxm5-80gb",
                         "--precision", "bf16", "--activation-precision", "fp8")
    assert code == 2
    assert "--activation-precision fp8 is narrower than the weights" in err
    code, _, _ = _json(capsys, "--model", "llama3-8b", "--gpu", "h100-sxm5-80gb",
                       "--precision", "fp8", "--activation-precision", "bf16")
    assert code == 0  # fp8 weights with 16-bit math: weight-only style, allowed


def test_notes_on_launch_share_and_mla_intervals(capsys):
    code, s, err = _json(capsys, "--model", "deepseek-v3", "--gpu", "b200", "--tp", "8",
                         "--precision", "fp8", "--interval")
    assert code == 0
    share = s["decode_s"]["launch"] / s["decode_s"]["total"]
    assert share > 0.25 and "launch_overhead=0" in err
    assert "no inference measurement of multi-head latent attention (MLA)" in err
    # 256 experts (more than any calibrated inference row: the novelty covariate, or the MoE
    # regime's, whichever the fitted error model weighs more) and MLA both widen the interval
    note = s["e2e_latency_interval_s"]["note"]
    assert "256 experts" in note
    assert "mla attention never calibrated" in note
    code, s, err = _json(capsys, "--model", "llama3-70b", "--gpu", "h100-sxm5-80gb", "--tp", "8",
                         "--batch", "256", "--interval")
    assert code == 0 and "MLA" not in err
    assert "note" not in s["e2e_latency_interval_s"]
