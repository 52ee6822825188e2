"""Activation memory kept by one BERT-base encoder layer, torch's vs slimformer's under
every recompute policy: the README's table, in bytes per token per hidden unit.

    python examples/layer_memory.py [--seq 512]

Measured with ``slimformer.memory.measure_activation_memory`` (saved-tensor hooks and
weak references to live tensors; the layer's input, output and parameters excluded)
in training mode (dropout 0.1), fp32. On a CPU the slimformer layers run their PyTorch
path, which saves exactly the tensors the kernels save.
"""

import argparse
import sys
from pathlib import Path

from slimformer.layers.policies import POLICIES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arguments import positive_int


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python examples/layer_memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=positive_int, default=512, help="sequence length (default 512)")
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch
from tqdm.auto import tqdm

import slimformer as sf
from slimformer.memory import measure_activation_memory

HIDDEN, HEADS, FFN = 768, 12, 3072


def layer_memory(seq: int) -> dict[tuple[str, str], float]:
    """{(layer, "post-LN" | "pre-LN"): bytes per token per hidden unit}."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    x = torch.randn(1, seq, HIDDEN, device=device, requires_grad=True)
    layers = {
        ("torch.nn.TransformerEncoderLayer", "post-LN"): torch.nn.TransformerEncoderLayer(
            HIDDEN, HEADS, FFN, 0.1, "gelu", batch_first=True, device=device
        )
    }
    for policy in POLICIES:
        for norm_first, column in ((False, "post-LN"), (True, "pre-LN")):
            layers[f"slimformer, {policy}", column] = sf.TransformerEncoderLayer(
                HIDDEN,
                HEADS,
                FFN,
                0.1,
                "gelu",
                batch_first=True,
                norm_first=norm_first,
                recompute=policy,
                device=device,
            )
    return {
        key: measure_activation_memory(layer, x).per_token(seq, HIDDEN)
        for key, layer in tqdm(layers.items(), desc="layers measured", unit="layer")
    }


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    kept = layer_memory(args.seq)
    print(f"bytes per token per hidden unit, BERT-base layer, seq {args.seq}, dropout 0.1, fp32")
    print("| layer | post-LN | pre-LN |\n|---|---|---|")
    for name in dict.fromkeys(name for name, _ in kept):
        cells = [f"{kept[name, column]:.1f}" if (name, column) in kept else "" for column in ("post-LN", "pre-LN")]
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
