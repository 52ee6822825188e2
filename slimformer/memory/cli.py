"""``python -m slimformer.memory``: the training-memory report of a HF BERT, eager vs slimformer.

``main`` builds a HF ``BertModel`` from a config (random weights, nothing downloaded),
converts a copy with ``slimformer.patch`` and prints the report
(``slimformer.memory.report``) for both; ``--plot`` adds activation memory vs sequence
length for eager, SDPA and every recompute policy (``activation_sweep``,
``plot_activation_sweep``). The conversion is imported when a model is built, so the
report library never depends on it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from slimformer._cli_args import output_file, positive_int
from slimformer.layers.policies import POLICIES

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["bert_config", "bert_inputs", "bert_variants", "build_bert", "checked_model_and_device", "main"]


BERT_SIZES = {
    "bert-base": {},  # BertConfig's defaults: 12 layers, hidden 768, 12 heads, FFN 3072
    "bert-large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096},
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch's names: the parser imports no torch
SWEEP_SEQS = (128, 256, 512, 1024, 2048, 4096)

_EPILOG = """\
The models are HF BertModel built from the config with random weights (nothing is
downloaded), in training mode (dropout on), cast to --dtype (pure 16-bit training on
both CPU and CUDA; AdamW state is still counted in fp32). Inputs: random token ids,
no padding. Sequences beyond the config's max_position_embeddings extend the position
table. "slimformer (POLICY)" is a copy of the eager model after
slimformer.patch.patch(model, recompute=POLICY).

The table gives the forward+backward peak on every device (CUDA: torch.cuda memory
stats; CPU: live tensor bytes) and on CUDA the step time. On CPU the slimformer layers
run their PyTorch path, which saves what the kernels save and works block by block. Each model costs
about three forwards, so BERT-base at batch 8, seq 512 in fp32 takes minutes and
several GiB of RAM on a CPU.

--plot measures the whole model's activations at seq 128, 256, ... up to --max-seq
for eager, SDPA and every policy. Eager at long sequences needs tens of GiB (the
score matrices): lower --max-seq on a CPU. On CPU, SDPA with dropout falls back to
PyTorch's math kernel and keeps what eager keeps, and the slimformer layers draw their
attention-dropout masks with Philox in plain PyTorch, which is slow at long sequences.
"""


def bert_config(spec: str):
    """``BertConfig`` for ``bert-base``, ``bert-large`` or a config.json (or a folder holding one)."""
    from transformers import BertConfig

    if spec in BERT_SIZES:
        return BertConfig(**BERT_SIZES[spec])
    if not Path(spec).exists():
        raise ValueError(f"--model must be one of {sorted(BERT_SIZES)} or a path to a config.json, got {spec!r}")
    return BertConfig.from_pretrained(spec)


def checked_model_and_device(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """(``bert_config(args.model)``, the resolved ``args.device``), or the parser's usage error
    (exit 2, one line) for either: the checks that need transformers and torch, before any work."""
    from slimformer.kernels.dispatch import resolve_device

    try:
        config = bert_config(args.model)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        parser.error(f"argument --device: {error}")
    return config, device


def build_bert(config, *, max_seq: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A randomly initialised ``BertModel`` with eager attention, in training mode."""
    from transformers import BertModel

    config = copy.deepcopy(config)
    config.max_position_embeddings = max(config.max_position_embeddings, max_seq)
    model = BertModel(config)
    model.set_attn_implementation("eager")
    return model.to(device=device, dtype=dtype).train()


def bert_inputs(config, batch: int, seq: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random token ids (fixed seed) and an attention mask without padding."""
    import torch

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(config.vocab_size, (batch, seq), generator=generator).to(device)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def _with_attention(model: nn.Module, implementation: str) -> nn.Module:
    model.set_attn_implementation(implementation)
    return model


def bert_variants(
    config,
    seed: int,
    max_seq: int,
    dtype: torch.dtype,
    device: torch.device,
    baselines: Sequence[str],
    policies: Sequence[str],
) -> dict[str, Callable[[], nn.Module]]:
    """Column name -> function readying its model: the baselines share one eager BERT (attention
    implementation switched), the policies one patched copy of it (policy switched)."""
    import torch

    from slimformer.recompute import recompute

    torch.manual_seed(seed)
    eager = build_bert(config, max_seq=max_seq, dtype=dtype, device=device)
    variants = {name: (lambda name=name: _with_attention(eager, name)) for name in baselines}
    if policies:
        from slimformer.patch import patch  # the conversion, imported only where a model is converted

        slim = patch(copy.deepcopy(eager), recompute=policies[0])
        variants.update({f"slimformer ({p})": (lambda p=p: recompute(slim, p)) for p in policies})
    return variants


@contextlib.contextmanager
def _long_lived_objects_frozen():
    """Every measurement collects garbage twice; leave the objects alive now (transformers,
    the models) out of those scans, which then take microseconds instead of ~0.2 s."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m slimformer.memory",
        description="Training memory of a HF BERT, eager vs slimformer: parameters, gradients, "
        "AdamW state and activations per layer, measured on this machine.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="bert-base", help="bert-base, bert-large, or a HF config.json or folder")
    parser.add_argument("--batch", type=positive_int, default=8, help="default 8")
    parser.add_argument("--seq", type=positive_int, default=512, help="default 512")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="fp32", help="the models are cast to it (default fp32)"
    )
    parser.add_argument(
        "--recompute", nargs="+", choices=[*POLICIES, "all"], default=["none"], help="slimformer columns (default none)"
    )
    parser.add_argument(
        "--baseline", nargs="+", choices=["eager", "sdpa"], default=["eager"], help="HF columns (default eager)"
    )
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--plot", metavar="PNG", type=output_file, help="also sweep the sequence length and plot")
    parser.add_argument(
        "--max-seq", type=positive_int, default=SWEEP_SEQS[-1], help="longest sequence of --plot's sweep (default 4096)"
    )
    parser.add_argument("--seed", type=int, default=0, help="for the random weights (default 0)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m slimformer.memory``: print the report (and write the plot); returns 0."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.plot and args.max_seq < SWEEP_SEQS[0]:
        parser.error(f"argument --max-seq: expected an integer >= {SWEEP_SEQS[0]} with --plot, got {args.max_seq}")
    # The checks that need torch or transformers, still before any work: usage errors like argparse's.
    import torch
    from rich.console import Console

    from slimformer.memory.report import (
        MemoryReport,
        activation_sweep,
        device_name,
        measure_model,
        plot_activation_sweep,
        progress_bar,
        sweep_title,
    )

    config, device = checked_model_and_device(parser, args)
    dtype = getattr(torch, DTYPES[args.dtype])
    policies = list(POLICIES) if "all" in args.recompute else list(dict.fromkeys(args.recompute))
    baselines = list(dict.fromkeys(args.baseline))

    console = Console()
    variants = bert_variants(config, args.seed, args.seq, dtype, device, baselines, policies)
    inputs = bert_inputs(config, args.batch, args.seq, device)
    measured = []
    models = {name: ready() for name, ready in variants.items()}  # the same objects ready() returns
    console.print(
        f"measuring {len(models)} models ({', '.join(models)}) on {device}: about three forwards each, "
        "one layer at a time"
    )
    with _long_lived_objects_frozen(), progress_bar(models) as step:
        for name, ready in variants.items():
            measured.append(measure_model(ready(), inputs, name=name, progress=step))
    title = f"{args.model}: batch {args.batch} x seq {args.seq}, {args.dtype}, training mode, {device_name(device)}"
    MemoryReport(tuple(measured), title).print()
    del variants, inputs
    gc.collect()

    if args.plot:
        seqs = [seq for seq in SWEEP_SEQS if seq <= args.max_seq]
        variants = bert_variants(config, args.seed, seqs[-1], dtype, device, ["eager", "sdpa"], POLICIES)
        with _long_lived_objects_frozen():
            sweep = activation_sweep(
                variants, lambda seq: bert_inputs(config, args.batch, seq, device), seqs, log=console.log
            )
        title = sweep_title(args.model, args.batch, dtype, config.hidden_dropout_prob, device)
        plot_activation_sweep(sweep, seqs, args.plot, title=title)
        console.print(f"wrote {args.plot}")
    return 0
