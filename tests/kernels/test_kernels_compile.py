"""Every kernel family compiles for Hopper (sm_90) in the specialisations the JIT builds for
the CI's representative shapes, within shared memory and, for 16-bit inputs at hidden
<= 8192 / head dim <= 256, without register spills; the attention's largest tiles also
for sm_80 and sm_86 (see tests/aot_compile.py)."""

import json

import pytest
from filelock import FileLock  # a dependency of torch

from tests.aot_compile import CompileResult, Selection, ci_cases, compile_selections, matching_cases

FAMILIES = ("attention", "norm", "dropout", "activation", "loss", "gemm")
# Cases that break a limit today, each with its reason; strict, so a fix must remove it.
KNOWN_FAILURES = {}

# sm_80 (A100) has 163 KB of shared memory (sm_90: 227 KB) and mma.sync, whose tiles
# accumulate in registers: its own attention block configs (``attention.configs.SM80``).
# d256 with dropout is the case closest to its limits (largest tiles in shared memory,
# most per-element state).
SM80_PATTERN = "attn d256 bf16 s512 fused-qkv dropout0.1"
# Compute capability 8.6 / 8.9 (RTX 30xx / 40xx, A10, L4) has 99 KB of shared memory per
# block and takes the 99 KB table (``attention.configs.SMALL_SHARED``): d256 and fp32's
# d256 backward are the launches that would not fit sm_80's. Compiled for sm_86, whose
# limit is 101376 B.
SM86_PATTERNS = (SM80_PATTERN, "attn d256 fp32")

# The sm_90 attention's headline: every pass's hot loop on wgmma, the forward's loads by
# TMA and the backward's by cp.async (read from the SASS, for one case).
WGMMA_CASE = "attn d72 bf16 s512 fused-qkv"
SELECTIONS = [
    *(Selection("sm90", ci_cases(family)) for family in FAMILIES),
    Selection("sm90", (WGMMA_CASE,), sass=True),
    Selection("sm80", matching_cases("attention", SM80_PATTERN)),
    *(Selection("sm86", matching_cases("attention", pattern)) for pattern in SM86_PATTERNS),
]
# one worker compiles them all for the whole run (``compiled``)
pytestmark = pytest.mark.xdist_group("compile")


@pytest.fixture(scope="session")
def compiled(request, tmp_path_factory) -> dict[Selection, CompileResult]:
    """Every selection's result, from one compile run for the whole test run. Where the tests
    do land on several workers (``-n`` without ``--dist loadgroup``), they share that run's
    result through a file in their common temporary directory, under a lock."""
    worker = getattr(request.config, "workerinput", None)
    if worker is None:
        return compile_selections(SELECTIONS)
    path = tmp_path_factory.getbasetemp().parent / f"compile-{worker['testrunuid']}.json"
    with FileLock(f"{path}.lock"):
        if not path.exists():
            path.write_text(json.dumps(list(compile_selections(SELECTIONS).values())))
        results = json.loads(path.read_text())
    return {selection: CompileResult(*result) for selection, result in zip(SELECTIONS, results)}


def _params():
    for selection in (s for s in SELECTIONS if not s.sass):  # the SASS case has its own test
        for case in selection.cases:
            marks = [pytest.mark.xfail(reason=KNOWN_FAILURES[case], strict=True)] if case in KNOWN_FAILURES else []
            yield pytest.param(selection, case, marks=marks, id=f"{selection.arch}-{case}")


@pytest.mark.parametrize(("selection", "case"), list(_params()))
def test_compiles_within_limits(compiled, selection, case):
    assert compiled[selection].problems[case] == []


def test_sm90_attention_hot_loops_run_wgmma_fed_by_tma_and_cp_async(compiled):
    [selection] = [s for s in SELECTIONS if s.sass]
    result = compiled[selection]
    assert result.problems[WGMMA_CASE] == []
    passes = {name.split(" / ")[1]: facts for name, facts in result.kernels.items()}
    assert set(passes) == {
        "_attention_fwd_kernel",
        "_attention_bwd_preprocess_kernel",
        "_attention_bwd_dkdv_kernel",
        "_attention_bwd_dq_kernel",
    }, passes
    for kernel, facts in passes.items():
        if kernel == "_attention_bwd_preprocess_kernel":  # a row sum of dO * O: no dot
            assert facts["mma"] == "–", facts
            continue
        assert facts["mma"] == "wgmma", (kernel, facts)
        kinds = {kind.split(".")[0] for kind in facts["hot_loop_loads"]}
        assert kinds == ({"TMA"} if kernel == "_attention_fwd_kernel" else {"cp"}), (kernel, facts)
