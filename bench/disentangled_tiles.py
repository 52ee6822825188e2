"""Where ``sf.disentangled_attention``'s GPU time goes, and which tile configuration is fastest.

On a CUDA GPU, at DeBERTa-v3-base's attention (bf16, batch 8, 12 heads, seq 512, head_dim 64,
256 buckets, both terms), it writes to ``--out``:

- a profile of one forward + backward call: every CUDA kernel and its device time
  (``torch.profiler``), so the kernels are told apart from the op's other launches;
- forward and forward + backward times (``triton.testing.do_bench``, median) of the kernels
  at each (block, warps, stages) of ``CONFIGS``, each configuration's block serving both
  BLOCK_M and BLOCK_N, and of the same call without position terms.

Stops starting new configurations once ``--budget`` seconds have passed; the report is
rewritten after each. Usage: ``python -m bench.disentangled_tiles --out DIR [--budget S]``.
"""

import argparse
import json
import math
import time
from pathlib import Path

from slimformer._cli_args import output_dir, positive_float


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.disentangled_tiles", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_dir, required=True, help="folder for disentangled-tiles.{md,json}")
    parser.add_argument(
        "--budget", type=positive_float, default=200.0, help="seconds before no new configuration starts"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a report already in --out")
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch

import slimformer as sf
from slimformer.kernels.attention import disentangled

SHAPE = (8, 12, 512, 64)
BUCKETS = 256
# (block, num_warps, num_stages) of the forward kernel, then of the two backward kernels
FORWARD_CONFIGS = [(32, 4, 1), (32, 4, 2), (32, 8, 2), (64, 4, 1), (64, 8, 1), (64, 8, 2), (16, 4, 2)]
BACKWARD_CONFIGS = [(32, 8, 1), (32, 8, 2), (32, 4, 1), (64, 8, 1), (16, 4, 1), (16, 4, 2)]


def _inputs(positions: bool) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch, heads, seq, head_dim = SHAPE
    shapes = [SHAPE] * 3 + ([(heads, 2 * BUCKETS, head_dim)] * 2 if positions else [])
    return [torch.randn(s, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_() for s in shapes]


def _call(inputs: list[torch.Tensor]) -> torch.Tensor:
    q, k, v, *positions = inputs
    pk, pq = positions or (None, None)
    return sf.disentangled_attention(
        q, k, v, pk, pq, position_buckets=BUCKETS, max_relative_positions=2 * BUCKETS,
        scale=1.0 / math.sqrt(3 * SHAPE[-1]),
    )  # fmt: skip


def _times(inputs: list[torch.Tensor]) -> dict[str, float]:
    import triton.testing

    grad = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)

    def both():
        _call(inputs).backward(grad)

    return {
        "forward_us": 1e3 * triton.testing.do_bench(lambda: _call(inputs), return_mode="median"),
        "forward_backward_us": 1e3 * triton.testing.do_bench(both, return_mode="median", grad_to_none=inputs),
    }


def _profile(inputs: list[torch.Tensor]) -> list[dict]:
    grad = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        _call(inputs).backward(grad)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            _call(inputs).backward(grad)
        torch.cuda.synchronize()
    rows = [
        {"kernel": e.key, "calls": e.count // 5, "device_us_per_call": e.device_time_total / 5}
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r["device_us_per_call"])


def _write(out: Path, report: dict) -> None:
    (out / "disentangled-tiles.json").write_text(json.dumps(report, indent=1))
    lines = [f"# disentangled attention tiles: {report['device']}, bf16 {SHAPE}, {BUCKETS} buckets", ""]
    lines += [
        "## Profile of one forward + backward (current tiles)",
        "",
        "| kernel | calls | device µs |",
        "|---|---|---|",
    ]
    lines += [f"| `{r['kernel'][:90]}` | {r['calls']} | {r['device_us_per_call']:.1f} |" for r in report["profile"]]
    lines += [
        "",
        "## Configurations",
        "",
        "| forward | backward | positions | fwd µs | fwd+bwd µs |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['forward']} | {r['backward']} | {r['positions']} | {r['forward_us']:.1f} | {r['forward_backward_us']:.1f} |"
        for r in report["configs"]
    ]
    (out / "disentangled-tiles.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.disentangled_tiles times the compiled kernels: it needs a CUDA GPU")
    if (args.out / "disentangled-tiles.json").exists() and not args.overwrite:
        raise SystemExit(f"{args.out} already holds a report: choose another --out or pass --overwrite")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    report = {"device": torch.cuda.get_device_name(), "profile": _profile(_inputs(True)), "configs": []}
    _write(args.out, report)
    default_blocks = disentangled._blocks
    plan = [(f, BACKWARD_CONFIGS[0], True) for f in FORWARD_CONFIGS]
    plan += [(FORWARD_CONFIGS[0], b, True) for b in BACKWARD_CONFIGS[1:]]
    plan += [(FORWARD_CONFIGS[0], BACKWARD_CONFIGS[0], False)]
    try:
        for forward_config, backward_config, positions in plan:
            if time.monotonic() - start > args.budget:
                break
            disentangled._blocks = lambda q, backward, f=forward_config, b=backward_config: b if backward else f
            row = {"forward": forward_config, "backward": backward_config, "positions": positions}
            try:
                row |= _times(_inputs(positions))
            except Exception as error:  # a configuration that does not compile or fit is a row too
                row |= {"forward_us": math.nan, "forward_backward_us": math.nan, "error": repr(error)[:300]}
            report["configs"].append(row)
            print(row, flush=True)
            _write(args.out, report)
    finally:
        disentangled._blocks = default_blocks


if __name__ == "__main__":
    main()
