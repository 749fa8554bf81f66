"""Picture of a serving SLO search (`diffperf serve --slo ... --plot F.png`): every simulated
deployment's output tokens/s per GPU against its p90 time to first token (aggregated: circles,
disaggregated xPyD: triangles), the throughput-latency front, the SLO's TTFT target and the
chosen deployment."""

from __future__ import annotations

from pathlib import Path

from ._pyplot import pyplot


def _label(row: dict) -> str:
    if row.get("mode") == "disaggregated":
        return (f"{row['prefill_replicas']:g}P{row['decode_replicas']:g}D, tp "
                f"{row['prefill_tp']:g} / {row['decode_tp']:g}, {row['max_num_seqs']:g} slots")
    return f"{row['replicas']:g} x tp {row['tp']:g}, {row['max_num_seqs']:g} slots"


def serving_front_plot(result: dict, path: str | Path, title: str):
    """Save the plot of `diffperf.serving.slo_search`'s `result`; returns the figure."""
    plt = pyplot("the serving plot")
    rows = [r for r in result["candidates"] if r["fits"]]
    if not rows:
        raise ValueError("serving plot: no candidate deployment fits")
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for mode, marker in (("aggregated", "o"), ("disaggregated", "^")):
        of_mode = [r for r in rows if r.get("mode", "aggregated") == mode]
        meets = [r for r in of_mode if r["meets"]]
        misses = [r for r in of_mode if not r["meets"]]
        for group, colour, label in ((misses, "0.7", "misses the SLO"),
                                     (meets, "C0" if mode == "aggregated" else "C2",
                                      "meets the SLO")):
            if group:
                ax.scatter([r["ttft_p90_ms"] for r in group],
                           [r["output_tok_s_per_gpu"] for r in group], s=12, color=colour,
                           marker=marker, label=f"{mode}, {label} ({len(group)})")
    front = result["front"]
    ax.step([r["ttft_p90_ms"] for r in front], [r["output_tok_s_per_gpu"] for r in front],
            where="post", color="C1", lw=1.2, label="throughput-latency front")
    if "ttft_p90" in result["slo_s"]:
        ax.axvline(1e3 * result["slo_s"]["ttft_p90"], color="C3", ls="--", lw=1,
                   label="TTFT p90 target")
    best = result["best"]
    if best:
        ax.scatter([best["ttft_p90_ms"]], [best["output_tok_s_per_gpu"]], marker="*", s=140,
                   color="C3", zorder=3,
                   label=f"fewest GPUs: {best['num_gpus']:g} ({_label(best)})")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT p90, ms")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)  # saved; pyplot keeps no reference (the figure stays usable)
    return fig
