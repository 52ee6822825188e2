"""The GPU check: one prepared command that proves slimformer on a GPU in a few minutes.

    python -m bench.gpu_check [--out DIR] [--budget 480] [--phases ...] [--dry-run]
    make gpu-check ARGS="--out /tmp/out"

It needs only a Python with torch, triton, transformers and pytest (pytest-xdist for
parallel tests) and the repository on ``PYTHONPATH``: nothing is installed or downloaded.
Four phases, each under a time cap that the budget scales (see ``phase_cap``):

1. environment: device, versions, revision; the copy bandwidth and matmul ceilings;
2. correctness: ``pytest -m gpu`` in parallel workers, JUnit XML and a failure summary;
3. speed: the curated kernel rows (``kernels.all_cases``) against their baselines in the
   same process, device time with the host's overhead off the clock, and host time;
4. model: BERT-base masked-LM training steps and INT8 inference (``model``).

While phase 2 runs, worker processes compile what phases 3 and 4 will launch
(``precompile``). The command line is ``cli``; the report (``gpu-<device>.md`` and ``.json``, ``report``) is rewritten
after every phase and every speed case; the targets' table is printed last.
``--dry-run`` runs every phase on the CPU at tiny sizes through the same code (the
PyTorch path), so ``make test`` keeps the check from rotting between GPU runs.
"""

import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("environment", "correctness", "speed", "model")
# the caps of a full-size run; a smaller budget shrinks the phases still to run in proportion
FULL_CAPS_S = {"environment": 20.0, "correctness": 240.0, "speed": 180.0, "model": 90.0}
DEFAULT_OUT = ROOT / "bench" / "results" / "gpu"
DRY_RUN_OUT = ROOT / "build" / "gpu-check-dry-run"


def phase_cap(phase: str, selected: list[str], deadline: float) -> float:
    """Seconds for ``phase``: its full cap, or its share of the time left beside the phases
    still to run (in proportion to their full caps), whichever is smaller."""
    later = [p for p in PHASES[PHASES.index(phase) :] if p in selected]
    left = deadline - time.monotonic()
    return max(0.0, min(FULL_CAPS_S[phase], left * FULL_CAPS_S[phase] / sum(FULL_CAPS_S[p] for p in later)))
