"""Compile the kernels the launchers really launch, for sm_90 / sm_80 / sm_86, without a GPU.

The interpreter accepts programs the GPU compiler rejects, and a kernel compiled with
other specialisations than the JIT's is a different binary (other registers, spills and
load instructions). So the tests run the compile report's own path in a fresh process
without TRITON_INTERPRET (``triton.jit`` picks the interpreter at decoration time):
``tools.compile_report`` captures the launches of the selected cases
(``tools.compile_report.cases``) on CPU tensors with the CUDA code paths, specialises them as
the JIT does and compiles them with Triton and ptxas. One process compiles every
selection of a test run: each would otherwise pay ~4 s of imports.
"""

import json
import os
import subprocess
import sys
from typing import NamedTuple

from tools.compile_report.cases import all_cases

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compiled_triton_env() -> dict[str, str]:
    """This process's environment without TRITON_INTERPRET, with the repository importable:
    for a subprocess whose ``triton.jit`` kernels are compiled, not interpreted."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def ci_cases(family: str) -> tuple[str, ...]:
    """The names of the family's CI cases (``tools.compile_report.cases``, ``ci=True``)."""
    return tuple(case.name for case in all_cases() if case.ci and case.family == family)


def matching_cases(family: str, pattern: str) -> tuple[str, ...]:
    """The names of the family's cases whose name contains every word of ``pattern``
    (``python -m tools.compile_report -k``)."""
    from tools.compile_report.report import select

    return tuple(case.name for case in select(all_cases(), pattern, ci_only=False) if case.family == family)


class Selection(NamedTuple):
    """Cases to compile for ``arch``; with ``sass``, their SASS is read too (cuobjdump, as
    long as ptxas again), for the facts of ``CompileResult.kernels``."""

    arch: str
    cases: tuple[str, ...]
    sass: bool = False


class CompileResult(NamedTuple):
    problems: dict[str, list[str]]  # case -> compile errors, limits broken, "no kernel launch captured"
    kernels: dict[str, dict]  # "case / kernel" -> {"mma": kind, "hot_loop_loads": {kind: n}} (with sass)


def compile_selections(selections: list[Selection]) -> dict[Selection, CompileResult]:
    """Each selection's problems (compile errors, shared memory over the arch's limit, spills
    in a 16-bit kernel within the supported sizes, a case that launched nothing) and with
    ``sass`` its kernels' facts. One subprocess compiles them all (``_main``).

    Raises AssertionError with the subprocess's output when it fails.
    """
    command = [sys.executable, "-m", "tests.aot_compile", json.dumps(selections)]
    result = subprocess.run(command, cwd=ROOT, env=compiled_triton_env(), capture_output=True, text=True)
    assert result.returncode == 0, f"compiling {selections} failed:\n{result.stderr[-4000:]}"
    results = json.loads(result.stdout.splitlines()[-1])
    return {selection: CompileResult(*found) for selection, found in zip(selections, results)}


def _result(selection: Selection, collections: list) -> CompileResult:
    from tools.compile_report.report import Collection, limit_violations
    from tools.compile_report.sass import mma_kind

    records = [r for c in collections for r in c.records if r.case.name in selection.cases]
    problems = {}
    for name in selection.cases:
        own = Collection(
            collections[0].device,
            [r for r in records if r.case.name == name],
            [e for c in collections for e in c.capture_errors if e[0] == name],
        )
        problems[name] = limit_violations(own) or ([] if own.records else ["no kernel launch captured"])
    kernels = {
        f"{r.case.name} / {r.launch.kernel}": {
            "mma": mma_kind(r.stats.mma_opcodes),
            "hot_loop_loads": r.stats.hot_loop_loads,
        }
        for r in records
        if selection.sass and r.stats
    }
    return CompileResult(problems, kernels)


def _main(selections: list[Selection]) -> list[CompileResult]:
    """Each selection's result. Each case is compiled once per arch (with the other cases of
    that arch, each distinct launch once), reading ptxas's report, and its SASS where a
    selection asks for it."""
    from tools.compile_report.capture import DEVICES
    from tools.compile_report.report import collect

    by_name = {case.name: case for case in all_cases()}
    collections = {}
    for arch in dict.fromkeys(s.arch for s in selections):
        with_sass = dict.fromkeys(n for s in selections if s.arch == arch and s.sass for n in s.cases)
        without = dict.fromkeys(n for s in selections if s.arch == arch for n in s.cases if n not in with_sass)
        collections[arch] = [
            collection
            for names, sass in ((with_sass, True), (without, False))
            if names
            for collection in collect([by_name[n] for n in names], [DEVICES[arch]], progress=False, sass=sass)
        ]
    return [_result(s, collections[s.arch]) for s in selections]


if __name__ == "__main__":
    print(json.dumps(_main([Selection(arch, tuple(cases), sass) for arch, cases, sass in json.loads(sys.argv[1])])))
