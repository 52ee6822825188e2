"""The GPU check's command line: ``python -m bench.gpu_check`` (see the package docstring)."""

import argparse
import os

from bench.gpu_check import DEFAULT_OUT, DRY_RUN_OUT, PHASES, ROOT
from slimformer._cli_args import non_negative_int, output_dir, positive_float, positive_int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_check",
        description="Prove slimformer on a GPU in one run: environment and ceilings, every GPU test, curated "
        "kernel timings against their baselines, BERT-base training and INT8 inference; a Markdown and a JSON "
        "report rewritten after every phase.",
    )
    parser.add_argument(
        "--out",
        type=output_dir,
        default=None,
        help=f"where the report goes (default {DEFAULT_OUT.relative_to(ROOT)}/, with --dry-run "
        f"{DRY_RUN_OUT.relative_to(ROOT)}/)",
    )
    parser.add_argument(
        "--budget",
        type=positive_float,
        default=480.0,
        help="seconds the whole run may take; the phases' caps shrink to fit (default 480)",
    )
    parser.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)} (default all)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="every phase on the CPU at tiny sizes, through the same code (no GPU needed)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing report in --out")
    parser.add_argument(
        "--test-workers",
        type=positive_int,
        default=None,
        help="pytest-xdist workers for the correctness phase (default: cores - precompile workers)",
    )
    parser.add_argument(
        "--precompile-workers",
        type=non_negative_int,
        default=None,
        help="processes compiling the speed and model phases' kernels during the tests "
        "(default 4; 1 with --dry-run; 0: none)",
    )
    parser.add_argument(
        "--tests",
        nargs="+",
        default=None,
        metavar="PATH_OR_ARG",
        help="what the correctness phase runs under -m gpu (default: tests)",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        default=None,
        metavar="TEXT",
        help="run only the speed cases whose key contains one of these (e.g. 'attention b32' norm)",
    )
    parser.add_argument("--precompile-worker", metavar="KEYS_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases:
        parser.error(f"--phases must be a comma-separated subset of {','.join(PHASES)}, got {args.phases!r}")
    args.phases = [p for p in PHASES if p in phases]
    if args.budget <= 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget}")
    if args.out is None:
        args.out = DRY_RUN_OUT if args.dry_run else DEFAULT_OUT
    return args


def main(argv: list[str] | None = None) -> int:
    # The kernels must compile, not be interpreted (and the dry run takes the PyTorch path):
    # TRITON_INTERPRET is read when slimformer's kernels are decorated, at import.
    os.environ.pop("TRITON_INTERPRET", None)
    args = parse_args(argv)
    if args.precompile_worker:
        from bench.gpu_check.precompile import worker

        worker(args.precompile_worker, args.dry_run)
        return 0
    from bench.gpu_check.run import run_check

    return run_check(args)
