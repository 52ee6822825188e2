"""The GPU check (``python -m bench.gpu_check``) cannot rot between GPU runs: its dry run goes
through every phase on the CPU, and its report logic is checked on rows built by hand."""

import json
import os
import subprocess
import sys
import time

import pytest

from bench.gpu_check import FULL_CAPS_S, phase_cap
from bench.gpu_check.attention import padded_lengths
from bench.gpu_check.correctness import read_junit
from bench.gpu_check.model import INFER_COLUMNS, TRAIN_COLUMNS
from bench.gpu_check.report import Target, speed_vs_best, targets
from tests.aot_compile import ROOT

# spawns pytest and a precompile worker: one worker of the suite runs it
pytestmark = pytest.mark.xdist_group("gpu_check")


def _run(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    result = _run("--dry-run", "--out", str(out), "--budget", "400")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result, json.loads((out / "gpu-dry-run-cpu.json").read_text())


def test_dry_run_goes_through_every_phase(dry_run):
    out, result, state = dry_run
    assert {name: p["status"] for name, p in state["phases"].items()} == dict.fromkeys(
        ("environment", "correctness", "speed", "model"), "done"
    )
    assert "errors" not in state
    assert state["ceilings"]["copy_gbps"] > 0 and state["ceilings"]["matmul_tflops"] > 0
    # every GPU test was collected (and skipped: no CUDA here)
    summary = state["correctness"]["summary"]
    assert summary["tests"] > 200 and summary["skipped"] == summary["tests"], summary
    # the precompile worker warmed slimformer's providers
    assert any(r.get("provider") == "slimformer" and "seconds" in r for r in state["precompile"]["results"])
    # every case ran, every slimformer provider got a time in every mode of its case
    speed = state["speed"]
    assert not speed["not_run"]
    families = {row["family"] for row in speed["rows"]}
    assert families == {"attention", "norm", "mlp", "gemm", "epilogue"}
    for row in speed["rows"]:
        for name, cell in row["results"].items():
            if name.startswith("slimformer"):
                assert cell.get("p50_us", 0) > 0, (row["case"], row["mode"], name, cell)
        assert row["baselines"], row["case"]
    assert set(state["model"]["train"]) == set(TRAIN_COLUMNS)
    assert all("tokens_per_s" in r for r in state["model"]["train"].values()), state["model"]["train"]
    assert set(state["model"]["infer"]) == set(INFER_COLUMNS)
    assert all(r["cosine_vs_fp16"] > 0.99 for r in state["model"]["infer"].values())
    plan_rows = state["model"]["plan"]["sf.plan"]["rows"]
    assert len(plan_rows) == 3 and all(abs(r["error"]) < 0.01 for r in plan_rows.values()), plan_rows
    assert len(state["targets"]) == 22
    markdown = (out / "gpu-dry-run-cpu.md").read_text()
    for heading in (
        "**Dry run**",
        "## Targets",
        "## Correctness",
        "### Attention",
        "### Norms",
        "### MLP",
        "### Inference GEMMs",
        "## Whole model",
        "sf.plan: the predicted step peak",
    ):
        assert heading in markdown
    assert (out / "gpu-dry-run-cpu-tests.xml").exists()
    assert "BERT-base MLM step" in result.stdout  # the summary table, printed last


def test_a_second_run_does_not_overwrite_the_report(dry_run):
    out, _, _ = dry_run
    before = (out / "gpu-dry-run-cpu.json").read_text()
    result = _run("--dry-run", "--out", str(out), "--phases", "environment", timeout=300)
    assert result.returncode == 2 and "--overwrite" in result.stderr
    assert (out / "gpu-dry-run-cpu.json").read_text() == before


def test_help_and_bad_arguments():
    result = _run("--help", timeout=120)
    assert result.returncode == 0 and "--dry-run" in result.stdout and "--budget" in result.stdout
    result = _run("--dry-run", "--no-such-option", timeout=120)
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr
    result = _run("--dry-run", "--phases", "speed,warp", timeout=120)
    assert result.returncode == 2 and "--phases" in result.stderr


def test_phase_caps_shrink_to_the_budget():
    phases = ["environment", "correctness", "speed", "model"]
    # plenty of time: the full caps
    assert phase_cap("correctness", phases, time.monotonic() + 10_000) == FULL_CAPS_S["correctness"]
    # 265 s for phases whose caps add up to 530: each gets half of its cap
    assert phase_cap("environment", phases, time.monotonic() + 265) == pytest.approx(10.0, abs=0.1)
    # the later phases share what is left in proportion to their caps
    assert phase_cap("speed", phases, time.monotonic() + 135) == pytest.approx(90.0, abs=0.1)
    assert phase_cap("model", ["model"], time.monotonic() + 30) == pytest.approx(30.0, abs=0.1)


def test_junit_failures_are_summarised(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" skipped="1" time="2.5">'
        '<testcase classname="tests.kernels.test_norm" name="test_a[x]"><failure message="AssertionError: dx: max '
        'error 1.8e-05&#10;second line">line 1\nline 2\nE   AssertionError: dx</failure></testcase>'
        '<testcase classname="t" name="test_b"/><testcase classname="t" name="test_c"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    result = read_junit(xml)
    assert result["summary"] == {"tests": 3, "passed": 1, "failed": 1, "errors": 0, "skipped": 1, "seconds": 2.5}
    [failure] = result["failures"]
    assert failure["test"] == "tests.kernels.test_norm::test_a[x]"
    assert failure["message"] == "AssertionError: dx: max error 1.8e-05"
    assert failure["traceback"][-1] == "E   AssertionError: dx"


def _row(family, mode, params, results, baselines, work=1e12, unit="TFLOP/s"):
    return dict(
        case="c",
        family=family,
        label="l",
        mode=mode,
        unit=unit,
        work=work,
        params=params,
        baselines=baselines,
        results=results,
    )


def test_targets_read_the_rows_they_name():
    shape = dict(batch=2, heads=2, seq=64, head_dim=16, causal=False)  # the dry run's first attention shape
    rows = [
        _row(
            "attention",
            "fwd",
            {**shape, "variant": "dense"},
            {
                "slimformer": {"p50_us": 100.0},
                "sdpa-flash": {"p50_us": 120.0},
                "sdpa-cudnn": {"p50_us": 90.0},
                "flex": {"error": "no"},
            },
            ["sdpa-flash", "sdpa-cudnn", "flex"],
        ),
        _row(
            "attention",
            "fwd",
            {**shape, "variant": "dropout"},
            {"slimformer": {"p50_us": 125.0}, "sdpa-flash": {"p50_us": 200.0}},
            ["sdpa-flash"],
        ),
        _row(
            "norm",
            "fwd",
            dict(op="LayerNorm", hidden=32),
            {"slimformer": {"p50_us": 1.0}},
            ["torch"],
            work=850_000,
            unit="GB/s",
        ),
    ]
    state = {"meta": {"dry_run": True}, "speed": {"rows": rows}, "ceilings": {"copy_gbps": 1000.0},
             "model": {"train": {"HF SDPA": {"tokens_per_s": 100.0, "peak_bytes": 1000},
                                 "slimformer qkv+mlp": {"tokens_per_s": 95.0, "peak_bytes": 400}}}}  # fmt: skip
    found = {t.name: t for t in targets(state)}
    fwd = found["attention (2, 2, 64, 16) fwd vs SDPA's best backend"]
    assert fwd.measured == pytest.approx(0.9) and fwd.met is False  # cuDNN's 90 µs is the best baseline
    assert found["attention (2, 2, 64, 16) bwd vs SDPA's best backend"].measured is None
    own = found["attention (2, 2, 64, 16) fwd, dropout 0.1 vs its own no-dropout speed"]
    assert own.measured == pytest.approx(0.8) and own.met
    assert found["attention (2, 2, 64, 16) fwd, dropout 0.1 vs SDPA's best with dropout"].measured == pytest.approx(1.6)
    norm = found["LayerNorm x 32 fwd: share of the copy bandwidth"]
    assert norm.measured == pytest.approx(0.85) and norm.met
    peak = found["BERT-base MLM step, qkv+mlp: peak vs HF SDPA's"]
    assert peak.measured == pytest.approx(0.4) and peak.verdict() == "missed (14% over the target)"
    assert found["BERT-base MLM step, qkv+mlp: tokens/s vs HF SDPA's"].met
    assert Target("t", 0.5, 1.0, True).verdict() == "missed (50% of the target)"
    assert speed_vs_best(rows[0], "slimformer") == pytest.approx(0.9)


def test_padding_is_about_half():
    for batch, seq in ((32, 512), (4, 8192), (2, 64)):
        lengths = padded_lengths(batch, seq)
        assert sorted(lengths) == sorted(set(lengths)) and max(lengths) <= seq
        assert sum(lengths) / (batch * seq) == pytest.approx(0.5, abs=0.01)
