"""examples/trainer_mlm.py: a slimformer-patched BertForMaskedLM trains under transformers'
Trainer (which keeps only the dataset columns the model's forward names), and torchrun with
two gloo processes (DDP) follows the one-process loss curve."""

import json
import os
import subprocess
import sys

import pytest

from tests.aot_compile import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "trainer_mlm.py")
TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "32", "--batch", "4", "--steps", "5",
        "--dropout", "0", "--word-vocab", "--quiet"]  # fmt: skip
# the two runs spawn three processes: one worker of the suite runs them
pytestmark = pytest.mark.xdist_group("trainer-example")


def _losses(tmp_path, processes: int) -> list[float]:
    out = tmp_path / f"losses-{processes}.json"
    launcher = (
        [sys.executable]
        if processes == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [*launcher, EXAMPLE, *TINY, "--losses", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    record = json.loads(out.read_text())
    assert record["world_size"] == processes
    return record["losses"]


def test_ddp_over_two_processes_follows_the_one_process_loss_curve(tmp_path):
    one, two = _losses(tmp_path, 1), _losses(tmp_path, 2)
    assert len(one) == len(two) == 5
    # the Trainer logs losses rounded to 4 decimals; the ranks sum in another order
    assert max(abs(a - b) for a, b in zip(one, two)) <= 2e-4, (one, two)
    assert one[-1] < one[0]
