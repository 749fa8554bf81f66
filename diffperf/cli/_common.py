"""What the subcommands share: the shipped data's path, the loaders of models, efficiencies
and training systems (with the warnings they print), and the default GPU of `train`."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import equinox as eqx

from .. import presets
from .._checks import as_float
from .._paths import BENCHMARKS_DATA
from ..specs._hf_config import transformer_from_hf_config
from ._checks import CliError

#: The GPU of `train` when neither --gpu nor --system is given.
DEFAULT_TRAIN_GPU = "a100-sxm4-80gb"

#: The shipped benchmark data (present in a source checkout / editable install).
BENCHMARKS = BENCHMARKS_DATA


def _load_efficiency(path, gpu=None):
    """The shipped (or a fitted file's) efficiency, with `gpu`'s per-GPU factors if it has them."""
    eff = presets.default_efficiency() if path is None else presets.efficiency_from_json(path)
    return eff.for_gpu(gpu) if gpu and hasattr(eff, "for_gpu") else eff


#: A training sequence length taken from a config's maximum context above this is flagged.
LONG_CONFIG_CONTEXT = 8192


def _load_model(name_or_path: str, seq_len=None, training: bool = False):
    """A preset or a Hugging Face config.json; the loader's warnings (shared experts,
    multimodal config) and, for training, a long context taken as the sequence length are
    printed as `warning: ...` lines on stderr, a sliding window as a `note: ...` line."""
    if not name_or_path.strip():
        raise CliError("--model is empty; give a preset id (diffperf presets) or the path of a "
                       "Hugging Face config.json")
    p = Path(name_or_path)
    if p.suffix.lower() == ".json" or p.is_dir() or p.is_file():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = transformer_from_hf_config(p, seq_len=seq_len, max_context=not training)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
        if float(m.sliding_window) > 0:
            layers, full = int(float(m.layers)), int(float(m.global_layers))
            print(f"note: sliding-window attention: {float(m.sliding_window):g} tokens in "
                  f"{layers - full} of {layers} layers", file=sys.stderr)
        if training and seq_len is None and float(m.seq_len) > LONG_CONFIG_CONTEXT:
            print(f"warning: training sequence length {float(m.seq_len):g} is the config's "
                  f"maximum context; pass --seq-len for the length you train at",
                  file=sys.stderr)
        return m
    m = presets.model(name_or_path, max_context=not training)
    if seq_len is not None:
        m = eqx.tree_at(lambda x: x.seq_len, m, as_float(seq_len))
        m.__check_init__()
    return m


def _train_system(args):
    """The preset system of `train` / `search train` before any --set: --system's network with
    --gpu's accelerator (each defaulting to the other's; neither: DEFAULT_TRAIN_GPU in its
    system), --nvlink-domain applied. Sets `args.gpu` to the GPU used."""
    if args.gpu is None:
        args.gpu = presets.system_gpu(args.system) if args.system else DEFAULT_TRAIN_GPU
    elif args.system:
        args.gpu = presets.system_gpu(args.gpu)  # a system id as --gpu: its GPU
        if presets.system_gpu(args.system) != args.gpu:
            print(f"note: --gpu {args.gpu} in --system {args.system}, which is built with "
                  f"{presets.system_gpu(args.system)}: {args.gpu}'s accelerator on "
                  f"{args.system}'s network (a what-if)", file=sys.stderr)
    system = presets.system(args.system or args.gpu,
                            nvlink_domain=getattr(args, "nvlink_domain", None))
    if args.system:
        system = eqx.tree_at(lambda s: s.accelerator, system, presets.gpu(args.gpu))
    return system
