"""Compile the kernels the launchers really launch, for Hopper (sm_90), without a GPU.

The interpreter accepts programs the GPU compiler rejects, and a kernel compiled with
other specialisations than the JIT's is a different binary (other registers, spills and
load instructions). So the tests run the compile report's own path in a fresh process
without TRITON_INTERPRET (``triton.jit`` picks the interpreter at decoration time):
``bench.compile_report`` captures the launches of the CI's representative cases
(``bench.compile_cases``, ``ci=True``) on CPU tensors with the CUDA code paths,
specialises them as the JIT does and compiles them with Triton and ptxas.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.compile_cases import all_cases

ROOT = Path(__file__).resolve().parent.parent


def ci_case_names(family: str) -> list[str]:
    return [case.name for case in all_cases() if case.ci and case.family == family]


def matching_case_names(family: str, pattern: str) -> list[str]:
    """The family's cases whose name contains every word of ``pattern`` (``-k``)."""
    from bench.compile_report import select

    return [case.name for case in select(all_cases(), pattern, ci_only=False) if case.family == family]


def compile_ci_cases(family: str, arch: str = "sm90", pattern: str | None = None) -> dict[str, list[str]]:
    """{case name: its problems} for the family's CI cases, or with ``pattern`` for its
    cases matching it (``matching_case_names``): compile errors, shared memory over
    ``arch``'s limit, spills in a 16-bit kernel within the supported sizes.

    Raises AssertionError with the subprocess's output when the report itself fails.
    """
    names = ci_case_names(family) if pattern is None else matching_case_names(family, pattern)
    selection = ["--ci"] if pattern is None else ["-k", pattern]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.json"
        command = [sys.executable, "-m", "bench.compile_report", *selection, "--family", family, "--arch", arch,
                   "--json", str(out), "--no-report", "--quiet", "-j", "1"]  # fmt: skip
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        assert result.returncode == 0 and out.exists(), f"compile report failed:\n{result.stderr[-4000:]}"
        data = json.loads(out.read_text())
    problems = {name: [] for name in names}
    for problem in data["problems"][arch]:
        name = next((n for n in problems if problem.startswith(f"{n}:") or problem.startswith(f"{n} /")), None)
        problems.setdefault(name or "(unattributed)", []).append(problem)
    launched = {record["case"] for record in data["records"]}
    for name in problems:
        if name in names and name not in launched and not problems[name]:
            problems[name].append("no kernel launch captured")
    return problems
