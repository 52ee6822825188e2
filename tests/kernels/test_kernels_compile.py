"""Every kernel family compiles for Hopper (sm_90) in the specialisations the JIT builds for
the CI's representative shapes, within shared memory and, for 16-bit inputs at hidden
<= 8192 / head dim <= 256, without register spills (see tests/aot_compile.py)."""

import functools
import json

import pytest
from filelock import FileLock  # a dependency of torch

from tests.aot_compile import ci_case_names, compile_ci_cases, matching_case_names

FAMILIES = ("attention", "norm", "dropout", "activation", "loss", "gemm")
# Cases that break a limit today, each with its reason; strict, so a fix must remove it.
KNOWN_FAILURES = {
}


@pytest.fixture(scope="session")
def problems(request, tmp_path_factory):
    """{case: problems} of a family, from one compile-report run per family for the whole
    test run: each family is an xdist group, and where a family's tests do land on several
    workers (``-n`` without ``--dist loadgroup``), they share the run's result through a
    file in their common temporary directory, under a lock."""
    worker = getattr(request.config, "workerinput", None)
    shared = None if worker is None else tmp_path_factory.getbasetemp().parent / f"compile-{worker['testrunuid']}"

    @functools.cache
    def family_problems(family: str) -> dict[str, list[str]]:
        if shared is None:
            return compile_ci_cases(family)
        shared.mkdir(exist_ok=True)
        path = shared / f"{family}.json"
        with FileLock(f"{path}.lock"):
            if not path.exists():
                path.write_text(json.dumps(compile_ci_cases(family)))
        return json.loads(path.read_text())

    return family_problems


def _params():
    for family in FAMILIES:
        for case in ci_case_names(family):
            marks = [pytest.mark.xdist_group(f"compile-{family}")]
            if case in KNOWN_FAILURES:
                marks.append(pytest.mark.xfail(reason=KNOWN_FAILURES[case], strict=True))
            yield pytest.param(family, case, marks=marks, id=case)


@pytest.mark.parametrize(("family", "case"), list(_params()))
def test_compiles_for_sm90_within_limits(problems, family, case):
    assert problems(family)[case] == []


# sm_80 (A100) has 163 KB of shared memory (sm_90: 227 KB) and mma.sync, whose tiles
# accumulate in registers: its own attention block configs (``_SM80_TENSOR_CORE_CONFIGS``).
# Two cases keep this cheap: d256 with dropout, and with every mask (largest tiles in
# shared memory, most per-element state), whose sm_90 configs needed 168 KB for dQ there.
SM80_PATTERN = "attn d256 bf16 s512 fused-qkv dropout0.1"


@pytest.fixture(scope="module")
def sm80_problems():
    return compile_ci_cases("attention", "sm80", SM80_PATTERN)


@pytest.mark.xdist_group("compile-sm80")  # one worker compiles them (the fixture is per module and worker)
@pytest.mark.parametrize("case", matching_case_names("attention", SM80_PATTERN))
def test_attention_compiles_for_sm80_within_limits(sm80_problems, case):
    assert sm80_problems[case] == []


# Compute capability 8.6 / 8.9 (RTX 30xx / 40xx, A10, L4) has 99 KB of shared memory per
# block and takes the 99 KB table (``_SMALL_SHARED_TENSOR_CORE_CONFIGS``): sm_80's configs
# needed 100 KB for the d256 forward and dQ (with or without dropout), and 128-132 KB for
# fp32's backward at d256. Compiled for sm_86, whose limit is 101376 B.
SM86_PATTERNS = (SM80_PATTERN, "attn d256 fp32")


@pytest.fixture(scope="module")
def sm86_problems():
    problems = {}
    for pattern in SM86_PATTERNS:
        problems.update(compile_ci_cases("attention", "sm86", pattern))
    return problems


SM86_CASES = [name for pattern in SM86_PATTERNS for name in matching_case_names("attention", pattern)]


@pytest.mark.xdist_group("compile-sm86")
@pytest.mark.parametrize("case", SM86_CASES)
def test_attention_compiles_for_sm86_within_limits(sm86_problems, case):
    assert sm86_problems[case] == []
