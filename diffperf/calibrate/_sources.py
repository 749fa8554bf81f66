"""Which published table (source group) a benchmark row comes from, and which rows are one
experiment: the units that cross-validation holds out together."""

from __future__ import annotations

import re

#: (regex on the row id, source group): one group per published table / document family.
SOURCE_RULES = (
    (r"^imec-korthi-", "imec-korthi"),
    (r"^imec-selene-", "imec-selene"),
    (r"^imec-inf-", "imec-inf"),
    (r"^narayanan21-t1-", "narayanan21-t1"),
    (r"^narayanan21-t2-", "narayanan21-t2"),
    (r"^korthikanti22-", "korthikanti22"),
    (r"^nemo24\.03", "nemo24.03"),
    (r"^nemo24\.07", "nemo24.07"),
    (r"^nemo25\.0\d", "nemo25.0x"),
    (r"^mbridge25\.09", "mbridge25.09"),
    (r"^mbridge25\.11", "mbridge25.11"),
    (r"^trtllm090-tput-", "trtllm090-tput"),
    (r"^trtllm090-ttft-", "trtllm090-ttft"),
    (r"^vtrain-single-", "vtrain-single"),  # 720 runs of small models, eager Megatron-DeepSpeed
    (r"^trtllm10-", "trtllm10"),  # held-out TensorRT-LLM 1.0 throughput tables (never fitted)
    (r"^mcore26-", "mcore26"),  # held-out MoE runs (never fitted): named for plots and reports
    (r"^deepseek-v3-", "deepseek-v3"),
)

#: Row-id prefixes of the IMEC validation subsets (leave-one-out).
IMEC_TRAIN = ("imec-korthi-", "imec-selene-")
IMEC_INFER = ("imec-inf-",)


def source_group(row_id: str, source: str = "") -> str:
    """The source group of a row: the group of its id in `SOURCE_RULES` (the shipped tables,
    whose `source` cells also cite the row within its table); otherwise its `source` column;
    an empty source: the id up to the first '-'."""
    for pattern, name in SOURCE_RULES:
        if re.match(pattern, row_id):
            return name
    return source.strip() or row_id.split("-", 1)[0]


def twin_key(row_id: str) -> str:
    """Rows with the same key are one experiment (`x` and `x-paper`)."""
    return row_id[: -len("-paper")] if row_id.endswith("-paper") else row_id


def source_of(row) -> str:
    """The source group of a `BenchmarkRow` (`source_group`)."""
    return source_group(row.id, row.source)
