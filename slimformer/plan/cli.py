"""The command line of ``sf.plan`` for a HF BERT built from a config (random weights,
nothing downloaded): the plan at a batch (by default the largest that fits), the
largest batch at the budget, and a plot of the predicted step peak against the batch
for every uniform policy and the plans ``sf.plan`` picks.
"""

import argparse
from pathlib import Path

from slimformer._cli_args import output_file, positive_int

__all__ = ["main"]

HEADS = {"mlm": "BertForMaskedLM", "cls": "BertForSequenceClassification", "token": "BertForTokenClassification"}
DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}  # autocast dtype: torch's name
# slimformer.plan.optimizer.OPTIMIZERS (tests/test_cli.py checks they agree), named here so that
# building the parser imports no torch
OPTIMIZERS = ("adamw", "adamw-fused", "adamw-in-backward")

_EPILOG = """\
The model is built from the config with random weights in fp32 (--dtype runs the step
under torch.autocast in that dtype), patched by slimformer.patch for the measurement.
The planner measures the step at 1, 2 and 4 rows under every recompute policy (a few
forwards and backwards of the whole model: a few minutes for BERT-base at seq 512 on
a CPU) and predicts every other batch and per-layer mix from them. The budget counts
every byte of a step: parameters, optimizer state, gradients, activations, transients.
On CPU the bytes are live tensor storages; on CUDA, torch.cuda's allocator statistics.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m slimformer.plan",
        description="Will it fit? The per-layer recompute plan, predicted step peak and largest batch of a "
        "HF BERT training step in a memory budget.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="bert-base", help="bert-base, bert-large or a path to a config.json")
    parser.add_argument("--head", choices=sorted(HEADS), default="mlm", help="the training head (default mlm)")
    parser.add_argument("--layers", type=positive_int, help="override the config's number of layers")
    parser.add_argument("--seq", type=positive_int, default=512, help="sequence length (default 512)")
    parser.add_argument("--budget", required=True, help="memory budget, e.g. 16GiB, 80GB or a number of bytes")
    parser.add_argument("--batch", type=positive_int, help="plan this batch (default: the largest that fits)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="autocast dtype (default fp32: none)")
    parser.add_argument("--unpad", action="store_true", help="patch with unpad=True (inputs have no padding here)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--plot", type=output_file, metavar="PNG", help="write the plot of peak vs batch to this .png")
    return parser


def _build(args, config, device):
    import transformers

    if args.layers is not None:
        config.num_hidden_layers = args.layers
    config.max_position_embeddings = max(config.max_position_embeddings, args.seq)
    model = getattr(transformers, HEADS[args.head])(config)
    return model.to(device).train()


def plot(profile_, flops, budget: int, chosen_batches: list[int], path: Path, title: str) -> None:
    """Predicted step peak vs batch: every uniform policy, the plan sf.plan picks at each
    batch where one fits, and the budget."""
    import matplotlib

    from slimformer.plan.planner import ladder

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(range(1, max(chosen_batches) * 2 + 1))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in profile_.policies:
        peaks = [profile_.predict((policy,) * len(profile_.layers), b).peak_bytes / 2**30 for b in batches]
        ax.plot(batches, peaks, label=f"uniform {policy}")
    picked = []
    for b in batches:
        fitting = [rung for rung in ladder(profile_, flops, b) if rung.prediction.peak_bytes <= budget]
        picked.append(fitting[0].prediction.peak_bytes / 2**30 if fitting else float("nan"))
    ax.plot(batches, picked, "ko-", markersize=3, label="sf.plan's pick")
    ax.axhline(budget / 2**30, color="red", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("batch")
    ax.set_ylabel("predicted step peak (GiB)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    # The checks that need torch or transformers, still before any work: usage errors like argparse's.
    import torch
    from rich.console import Console

    from slimformer.memory.cli import checked_model_and_device
    from slimformer.memory.measure import format_bytes
    from slimformer.plan.planner import choose, largest_batch, parse_budget, profile, synthetic_batch

    try:
        budget = parse_budget(args.budget)
    except (TypeError, ValueError) as error:
        parser.error(f"argument --budget: {error}")
    config, device = checked_model_and_device(parser, args)
    autocast = None if DTYPES[args.dtype] is None else getattr(torch, DTYPES[args.dtype])

    console = Console()
    model = _build(args, config, device)
    example = synthetic_batch(model, 2, args.seq, device)
    with console.status("measuring") as status:
        profile_, flops = profile(
            model,
            example,
            optimizer=args.optimizer,
            autocast=autocast,
            unpad=args.unpad,
            progress=lambda text: status.update(f"measuring: {text}"),
        )
    try:
        most = largest_batch(profile_, flops, budget)
    except ValueError as error:
        console.print(f"[red]{error}")
        return 1
    batch = args.batch or most
    try:
        chosen = choose(profile_, flops, budget, batch, unpad=args.unpad, autocast=autocast)
    except ValueError as error:
        console.print(f"[red]{error}")
        return 1
    console.print(chosen)
    console.print(f"largest batch at seq {args.seq} in {format_bytes(budget)} with {args.optimizer}: {most}")
    if args.plot:
        title = f"{args.model} {args.head}, seq {args.seq}, {args.optimizer}, {args.dtype}, {device.type}"
        plot(profile_, flops, budget, [batch, most], args.plot, title)
        console.print(f"plot: {args.plot}")
    return 0
