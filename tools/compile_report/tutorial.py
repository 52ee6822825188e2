"""Measure the Triton tutorial's fused attention (06-fused-attention.py) the way the
compile report measures slimformer's, as a reference for its tables.

    python -m tools.compile_report.tutorial PATH/TO/06-fused-attention.py [--commit SHA] [--overwrite]

The tutorial is not part of slimformer (nor copied into it): pass a copy of it from
triton-lang/triton. Its launches are captured on CPU tensors exactly like ours
(``capture``: on sm_90 it takes its TMA path, on sm_80 block pointers), every
forward autotune config is compiled, and the figures are written to
``bench/results/tutorial-attention-reference.json`` (git-ignored), which the report
quotes; an existing one is replaced only with ``--overwrite``.
"""

import argparse
import json
import sys
from pathlib import Path

from tools.compile_report.report import TUTORIAL_REFERENCE, loads_text
from tools.results import refuse_to_replace, shown


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.compile_report.tutorial", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("path", help="a copy of python/tutorials/06-fused-attention.py")
    parser.add_argument("--commit", default="unknown", help="the triton-lang/triton commit the copy is from")
    parser.add_argument("--overwrite", action="store_true", help=f"replace {shown(TUTORIAL_REFERENCE)}")
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch

from tools.compile_report.capture import DEVICES, capture, load_module_from_file
from tools.compile_report.figures import tile_instructions
from tools.compile_report.sass import analyse

MODULE = "triton_tutorial_fused_attention"
# The tutorial's own benchmark shape: batch 4, 32 heads, fp16.
BATCH, HEADS, SEQ = 4, 32, 1024


def _run(module, head_dim: int):
    def forward():
        q, k, v = (torch.randn(BATCH, HEADS, SEQ, head_dim, dtype=torch.float16, requires_grad=True) for _ in range(3))
        out = module.attention(q, k, v, False, head_dim**-0.5)
        return lambda: out.backward(torch.randn_like(out))

    return forward


def measure(path: str, arch: str) -> list[dict]:
    device = DEVICES[arch]
    module = load_module_from_file(MODULE, path, device)
    rows = []
    for head_dim in (64, 128):
        for launch in capture(device, _run(module, head_dim), f"tutorial d{head_dim}").launches:
            try:
                stats = analyse(launch)
            except Exception as error:  # the autotuner skips configs that fail to compile
                print(f"skipped {launch.kernel} {launch.note}: {type(error).__name__}", file=sys.stderr)
                continue
            constexprs = launch.named_constexprs()
            blocks = "×".join(str(v) for k, v in constexprs.items() if k.startswith("BLOCK") and isinstance(v, int))
            tile = tile_instructions(launch, stats)
            rows.append(
                dict(
                    arch=device.arch,
                    kernel=launch.kernel,
                    phase=launch.phase,
                    head_dim=head_dim,
                    config=f"{blocks}, {stats.num_warps}/{stats.num_stages}",
                    registers=stats.registers,
                    spills=stats.spill_bytes,
                    smem_kb=round(stats.shared_bytes / 1024, 1),
                    mma=stats.mma_kind,
                    loads=loads_text(stats.hot_loop_loads),
                    hot_loop=stats.hot_loop.instructions if stats.hot_loop else None,
                    loops=[loop.instructions for loop in stats.loops],
                    tile=round(tile) if tile else None,
                    best=False,
                )
            )
    for head_dim in (64, 128):
        forward = [r for r in rows if r["head_dim"] == head_dim and r["phase"] == "fwd" and r["tile"]]
        if forward:
            min(forward, key=lambda r: r["tile"])["best"] = True
    return rows


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not Path(args.path).is_file():
        parser.error(f"path must be a copy of 06-fused-attention.py, got {args.path!r}, which is no file")
    refuse_to_replace(parser, [TUTORIAL_REFERENCE], args.overwrite)
    rows = [row for arch in ("sm90", "sm80") for row in measure(args.path, arch)]
    source = (
        f"triton-lang/triton `python/tutorials/06-fused-attention.py` at {args.commit}, fp16, batch {BATCH}, "
        f"{HEADS} heads, seq {SEQ}, not causal; every forward autotune config the tutorial keeps for the target "
        "(sm_90: its TMA kernel; sm_80: block pointers); its backward is one fused kernel with four loops "
        "(`loops`: each innermost loop's SASS). Measured by `python -m tools.compile_report.tutorial`."
    )
    TUTORIAL_REFERENCE.write_text(json.dumps(dict(source=source, rows=rows), indent=1) + "\n")
    for row in rows:
        if row["best"]:
            print(
                f"sm{row['arch']} d{row['head_dim']} best fwd config {row['config']}: {row['tile']} warp-instr / 128²"
            )
    print(f"wrote {shown(TUTORIAL_REFERENCE)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
