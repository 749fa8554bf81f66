"""What the subcommands share: the shipped data's path, the loaders of models, efficiencies
and training systems (with the warnings they print), the default model and GPU of training and
of inference, and the model / hardware / plan / output option groups."""

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

#: The defaults of the model and hardware options, one set for every command: training
#: (`train`, `search train`, `sensitivity`, `attribution`) is GPT-3 175B on A100-80GB, as in
#: Megatron-LM's papers; inference (`infer`, `search infer`, `--workload infer`, `technology`)
#: Llama-2 70B on H100-SXM5-80GB, as in the NVIDIA / TensorRT-LLM measurements of the fit.
DEFAULT_TRAIN_MODEL = "gpt3-175b"
DEFAULT_TRAIN_GPU = "a100-sxm4-80gb"
DEFAULT_INFER_MODEL = "llama2-70b"
DEFAULT_INFER_GPU = "h100-sxm5-80gb"

#: Titles of the option groups every command's --help shows, in this order.
GROUPS = {"model": "model", "hardware": "hardware", "runtime": "software runtime",
          "plan": "plan (parallelism, batch, lengths, precision)", "output": "output",
          "engine": "serving engine (scheduler)", "traffic": "traffic",
          "cost": "cost and energy", "search": "SLO search"}


def group(parser, name: str):
    """The `name` option group ("model", "hardware", "runtime", "plan", "output") of `parser`,
    created on first use, so that every command lists its options under the same headings
    (the runtime's right after the hardware's)."""
    title = GROUPS[name]
    for g in parser._action_groups:
        if g.title == title:
            return g
    new = parser.add_argument_group(title)
    titles = [g.title for g in parser._action_groups]
    if name == "runtime" and GROUPS["hardware"] in titles:
        parser._action_groups.remove(new)
        parser._action_groups.insert(titles.index(GROUPS["hardware"]) + 1, new)
    return new


def add_model_argument(parser, default: str | None = DEFAULT_TRAIN_MODEL, *,
                       default_text: str | None = None) -> None:
    """`--model`: a preset id, a model JSON file or a Hugging Face config.json, for every
    command."""
    group(parser, "model").add_argument(
        "--model", default=default,
        help=f"model preset id (diffperf presets) or path to a Hugging Face config.json "
             f"(default {default_text or default}) or to a model JSON file with the fields of "
             f"a preset (docs/spec-files.md)")


def add_gpu_argument(parser, default: str | None = DEFAULT_INFER_GPU, *,
                     default_text: str | None = None, what: str = "GPU or system") -> None:
    """`--gpu`: a GPU or system preset id (or a prefix naming one), or a GPU or system JSON
    file."""
    group(parser, "hardware").add_argument(
        "--gpu", default=default,
        help=f"{what} preset id or a prefix naming one, e.g. h100, or a GPU or system JSON file "
             f"(docs/spec-files.md; diffperf presets export ID writes one) (default "
             f"{default_text or default})")


def add_output_arguments(parser, *, plot: str | None = None, out: str | None = None,
                         json: bool = True) -> None:
    """`--json`, and where the command has them `--plot FILE` and `--out FILE` (each written
    file is reported as `wrote FILE` on stderr)."""
    g = group(parser, "output")
    if out is not None:
        g.add_argument("--out", default=None, help=out)
    if plot is not None:
        g.add_argument("--plot", default=None, help=plot + " (matplotlib; the format follows "
                                                           "the extension: .png, .pdf, .svg)")
    if json:
        g.add_argument("--json", action="store_true", help="print one JSON object")


def wrote(path) -> None:
    """Say on stderr which file a command wrote (stdout stays the result)."""
    print(f"wrote {path}", file=sys.stderr)

#: The shipped benchmark data (present in a source checkout / editable install).
BENCHMARKS = BENCHMARKS_DATA


def _load_efficiency(path, gpu=None):
    """The shipped (or a fitted file's) efficiency, with `gpu`'s per-GPU factors if it has them."""
    eff = presets.default_efficiency() if path is None else presets.efficiency_from_json(path)
    return eff.for_gpu(gpu) if gpu and hasattr(eff, "for_gpu") else eff


#: A training sequence length taken from a config's maximum context above this is flagged.
LONG_CONFIG_CONTEXT = 8192


def _load_model(name_or_path: str, seq_len=None, training: bool = False):
    """A preset, a model JSON file (presets.model_from_file) or a Hugging Face config.json
    (told apart by their fields: `layers`, `hidden`, ... or `model_type`, `hidden_size`, ...);
    the config loader's warnings (shared experts,
    multimodal config) and, for training, a long context taken as the sequence length are
    printed as `warning: ...` lines on stderr, a sliding window as a `note: ...` line."""
    if not name_or_path.strip():
        raise CliError("--model is empty; give a preset id (diffperf presets), a model JSON "
                       "file or the path of a Hugging Face config.json")
    p = Path(name_or_path)
    if name_or_path.lower() in presets.model_names():
        pass  # a preset id, even where a file of that name exists
    elif (p.suffix.lower() == ".json" or p.is_file()) and presets.is_model_file(p):
        return _seq_len(presets.model_from_file(p, max_context=not training), seq_len)
    elif p.suffix.lower() == ".json" or p.is_dir() or p.is_file():
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
    return _seq_len(presets.model(name_or_path, max_context=not training), seq_len)


def _seq_len(m, seq_len):
    """Model `m` with --seq-len (None: its own)."""
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
