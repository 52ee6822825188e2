"""Each public op's call dispatches what ``tests/data/launch_budgets.json`` says on the CUDA
path: Triton launches, torch ops, torch kernels, custom-op dispatches and host syncs,
counted on a CPU (``tests.launch_budgets``). A regression in host overhead fails here
without a GPU; a deliberate change renews the file."""

import json
import subprocess
import sys

import pytest

from tests.aot_compile import ROOT, compiled_triton_env
from tests.launch_budgets import BUDGETS, CALLS

RENEW = "env -u TRITON_INTERPRET python -m tests.launch_budgets --write"


@pytest.fixture(scope="module")
def measured() -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "tests.launch_budgets"],
        cwd=ROOT,
        env=compiled_triton_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout[result.stdout.index("{") :])


def test_every_call_has_a_budget():
    assert sorted(json.loads(BUDGETS.read_text())) == sorted(CALLS), f"renew the budgets: {RENEW}"


@pytest.mark.parametrize("call", sorted(CALLS))
def test_call_dispatches_its_budget(measured, call):
    budget = json.loads(BUDGETS.read_text())[call]
    got = measured[call]
    changes = [
        f"{phase} {key}: budget {budget[phase][key]}, now {got[phase][key]}"
        for phase in budget
        for key in budget[phase]
        if key != "ops" and budget[phase][key] != got[phase].get(key)
    ]
    assert sorted(got) == sorted(budget), f"phases {sorted(got)}, budget has {sorted(budget)}"
    assert not changes, (
        f"{call}: " + "; ".join(changes) + "\n"
        + "".join(f"{phase} ops now {got[phase]['ops']}, budget {budget[phase]['ops']}\n" for phase in budget)
        + f"fewer is progress, more a host-overhead regression; either way renew the budgets once deliberate: {RENEW}"
    )  # fmt: skip


def test_counts_see_a_torch_op_added_around_a_launch():
    # The counter must see what a regression adds: a memset and a host sync beside a kernel launch.
    script = """
import json, torch
import slimformer as sf
from tests.launch_budgets import _counted
x = torch.zeros(64, 32, dtype=torch.bfloat16)
w = torch.ones(32, dtype=torch.bfloat16)
def regressed():
    out = sf.rms_norm(x, (32,), w)
    torch.zeros(64, 32).sum().item()
    return out
print(json.dumps([_counted(lambda: sf.rms_norm(x, (32,), w))[1], _counted(regressed)[1]]))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=compiled_triton_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    plain, regressed = json.loads(result.stdout[result.stdout.index("[") :])
    assert plain["launches"] == regressed["launches"] == 1
    assert regressed["torch_ops"] == plain["torch_ops"] + 3  # zeros, sum, item
    assert regressed["torch_kernels"] == plain["torch_kernels"] + 3
    assert (plain["syncs"], regressed["syncs"]) == (0, 1)
