"""Every kernel family compiles for Hopper (sm_90) in the specialisations the JIT builds for
the CI's representative shapes, within shared memory and, for 16-bit inputs at hidden
<= 8192 / head dim <= 256, without register spills (see tests/aot_compile.py)."""

import functools

import pytest

from tests.aot_compile import ci_case_names, compile_ci_cases

FAMILIES = ("attention", "norm", "dropout", "activation", "loss", "gemm")
# Cases that break a limit today, each with its reason; strict, so a fix must remove it.
KNOWN_FAILURES = {
}


@functools.cache
def _problems(family: str) -> dict[str, list[str]]:
    # One compile-report run per family (the xdist group keeps a family on one worker).
    return compile_ci_cases(family)


def _params():
    for family in FAMILIES:
        for case in ci_case_names(family):
            marks = [pytest.mark.xdist_group(f"compile-{family}")]
            if case in KNOWN_FAILURES:
                marks.append(pytest.mark.xfail(reason=KNOWN_FAILURES[case], strict=True))
            yield pytest.param(family, case, marks=marks, id=case)


@pytest.mark.parametrize(("family", "case"), list(_params()))
def test_compiles_for_sm90_within_limits(family, case):
    assert _problems(family)[case] == []
