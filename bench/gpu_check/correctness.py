"""Phase 2: every GPU test (``pytest -m gpu``), in parallel workers so Triton compiles on
every core, under the phase's time cap.

At the cap pytest gets SIGINT, which makes it stop, write its JUnit XML and print its
summary (the tests that ran keep their results); 30 s later it is killed. The XML is
read back into counts and one entry per failure: its test id, message and the last
lines of its traceback (pytest's ``E`` lines and the failing line: where the reason is).
"""

import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from bench.gpu_check import ROOT

TRACEBACK_LINES = 12
_INTERRUPT_GRACE_S = 30


def run_gpu_tests(junit: Path, log: Path, cap_s: float, workers: int, selection: list[str]) -> dict:
    """Run ``pytest -m gpu`` (``selection``: paths / -k arguments, default the whole suite)
    into ``junit`` and ``log``; returns {"summary": counts, "failures": [...], ...}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [sys.executable, "-m", "pytest", *(selection or ["tests"]), "-m", "gpu", "-p", "no:cacheprovider",
               "-q", "-rfE", "--timeout", "150", f"--junitxml={junit}"]  # fmt: skip
    if workers > 1:
        command += ["-n", str(workers)]
    interrupted = False
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            returncode = process.wait(timeout=cap_s)
        except subprocess.TimeoutExpired:
            interrupted = True
            process.send_signal(signal.SIGINT)
            try:
                returncode = process.wait(timeout=_INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                returncode = process.wait()
    result = read_junit(junit) if junit.exists() else {"summary": {}, "failures": []}
    result.update(command=" ".join(command[1:]), returncode=returncode, interrupted=interrupted, cap_s=cap_s)
    return result


def read_junit(path: Path) -> dict:
    """Counts (tests, passed, failed, errors, skipped, seconds) and the failures of a JUnit XML."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {
        key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")
    }
    seconds = sum(float(suite.get("time", 0.0)) for suite in suites)
    failures = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            element = case.find(kind)
            if element is None:
                continue
            text = (element.text or "").strip().splitlines()
            failures.append(
                {
                    "test": f"{case.get('classname', '')}::{case.get('name', '')}",
                    "kind": kind,
                    "message": (element.get("message") or "").splitlines()[0][:300] if element.get("message") else "",
                    "traceback": text[-TRACEBACK_LINES:],
                }
            )
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    summary = {"tests": counts["tests"], "passed": passed, "failed": counts["failures"], "errors": counts["errors"],
               "skipped": counts["skipped"], "seconds": round(seconds, 1)}  # fmt: skip
    return {"summary": summary, "failures": failures}
