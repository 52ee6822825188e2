"""Where the repository's commands write their results, and the ``--out`` / ``--overwrite``
convention they share (the benchmarks in bench/ and the compile report in tools/)."""

import argparse
from pathlib import Path

from slimformer._cli_args import output_dir

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"  # the committed reference results
LOCAL_RESULTS = RESULTS / "local"  # git-ignored: where a run writes unless told otherwise


def shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it, else as it is."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--out DIR`` and ``--overwrite``, the same for every command that writes results."""
    parser.add_argument(
        "--out",
        type=output_dir,
        default=LOCAL_RESULTS,
        metavar="DIR",
        help=f"folder the results go to (default {shown(LOCAL_RESULTS)}/, git-ignored; the committed reference "
        f"results are in {shown(RESULTS)}/)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace files of the same names in --out")


def refuse_to_replace(parser: argparse.ArgumentParser, paths: list[Path], overwrite: bool) -> None:
    """Stop with a usage error naming the files among ``paths`` that exist, unless ``overwrite``:
    a run never silently replaces results (the committed reference results among them)."""
    existing = [shown(path) for path in paths if path.exists()]
    if existing and not overwrite:
        parser.error(f"{', '.join(existing)} already exist(s); pass --overwrite to replace, or choose another --out")
