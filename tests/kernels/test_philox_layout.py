"""The attention dropout's inline PTX is right in the layouts the compiled kernels give it.

Compiled, ``philox.dropout_mma_words`` swaps Philox words between lanes ``lane`` and
``lane ^ 4`` with ``shfl.sync.bfly``: the partner's values along dimension 2 of its
[x // 16, x % 8 // 2, 2, y // 32, y % 8 // 2] tensors (the interpreter, which runs every
other test, swaps that dimension instead). That is the same thing only where lane bit 2
walks dimension 2 and nothing else, and ``dropout_mma_apply`` reads one pair of words per
two 16-bit elements, right where a register pair holds two columns of one row. Both are
facts of the layouts Triton assigns, so this test runs the JIT's passes on the attention
kernels for sm_90 and sm_80, specialised exactly as the JIT would, up to the TTGIR
(``tools.compile_report.capture.ttgir_of_launch``, in a process without TRITON_INTERPRET), and
reads them there: the swap's operand must be a linear
layout whose lane basis 2 is the unit vector of dimension 2, and the 16-bit apply's
operands must be in a tensor-core accumulator layout (whose threads hold column pairs
2c, 2c + 1) or a linear layout whose register basis 0 is column bit 0.
"""

import ast
import json
import os
import re
import subprocess
import sys

from tests.aot_compile import ROOT

# Every sm_90 config a 16-bit dropout launch takes (``attention.configs.SM90``, the "dropout"
# and "masked" kinds at d64, d128, d256, for dQ apart or atomic, dense or varlen), in fp16 and
# bf16, causal or not; sm_80, whose launches take no lane swap, for its packed apply.
CASES = {
    "sm90": [
        "attn d64 bf16 s512 fused-qkv dropout0.1",
        "attn d128 bf16 s512 fused-qkv dropout0.1",
        "attn d256 bf16 s512 fused-qkv dropout0.1",
        "attn d64 fp16 s512 fused-qkv causal dropout0.1",
        "attn d64 bf16 s512 fused-qkv causal dropout0.1 key-padding",
        "attn d128 bf16 s512 fused-qkv causal dropout0.1 key-padding",
        "attn d256 bf16 s512 fused-qkv dropout0.1 bool-mask key-padding",
        "attn d64 bf16 s512 fused-qkv dropout0.1 atomic-dq",
        "attn d128 bf16 s512 fused-qkv dropout0.1 atomic-dq",
        "attn d64 bf16 s512 varlen causal dropout0.1",
        "attn d128 bf16 s512 varlen dropout0.1",
    ],
    "sm80": ["attn d128 bf16 s512 fused-qkv dropout0.1"],
}
_SWAP = "shfl.sync.bfly.b32 $0, $1, 4"
_APPLY = "prmt.b32 m, f0, f1, $"
_OPERAND = re.compile(r"tensor<([0-9x]+)x(?:i|f|bf)\d+, (#[\w.]+)>")


def _bases(definition: str, name: str) -> list[list[int]]:
    match = re.search(rf"\b{name} = (\[(?:\[[-\d, ]*\](?:, )?)*\])", definition)
    assert match, f"no {name} bases in {definition}"
    return ast.literal_eval(match.group(1))


def _lane_bases(definition: str, shape: list[int]) -> list[list[int]] | None:
    """The lane bases of a linear or blocked layout of ``shape`` (None for other layouts): the
    tensor index that each lane-id bit adds."""
    if definition.startswith("#ttg.linear<"):
        return _bases(definition, "lane")
    if not definition.startswith("#ttg.blocked<"):
        return None
    per_thread, threads, order = (
        ast.literal_eval(re.search(rf"\b{key} = (\[[\d, ]*\])", definition).group(1))
        for key in ("sizePerThread", "threadsPerWarp", "order")
    )
    bases = []
    for dim in order:  # fastest first; a layout wider than the tensor wraps (powers of two: to 0)
        for bit in range(threads[dim].bit_length() - 1):
            step = per_thread[dim] << bit
            bases.append([step if d == dim and step < shape[dim] else 0 for d in range(len(shape))])
    return bases


def layout_problems(ttgir: str) -> tuple[int, int, list[str]]:
    """(lane swaps, applies, the problems found) in a kernel's TTGIR."""
    aliases = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, flags=re.M))
    swaps, applies, problems = 0, 0, []
    for line in ttgir.splitlines():
        if "tt.elementwise_inline_asm" not in line:
            continue
        operands = _OPERAND.findall(line.split(" : ", 1)[-1])
        if _SWAP in line:
            swaps += 1
            for shape, encoding in operands:
                definition = aliases.get(encoding, encoding)
                sizes = [int(n) for n in shape.split("x")]
                lanes = _lane_bases(definition, sizes)
                if lanes is None or lanes[2] != [int(d == 2) for d in range(len(sizes))]:
                    problems.append(f"lane swap on tensor<{shape}> in {definition}: lane bit 2 is not dimension 2")
        elif _APPLY in line:
            applies += 1
        if _APPLY in line and "packed_element = 2" in line:
            for shape, encoding in operands:
                definition = aliases.get(encoding, encoding)
                if definition.startswith("#ttg.nvidia_mma<"):
                    continue
                if not definition.startswith("#ttg.linear<") or _bases(definition, "register")[:1] != [[0, 1]]:
                    problems.append(f"16-bit apply on tensor<{shape}> in {definition}: register pairs are not columns")
    return swaps, applies, problems


def compile_and_check(cases: dict[str, list[str]]) -> dict[str, dict]:
    """{arch / case / kernel: {"swaps": n, "applies": n, "problems": [...]}} (run without TRITON_INTERPRET)."""
    from tools.compile_report.capture import DEVICES, capture, ttgir_of_launch
    from tools.compile_report.cases import all_cases

    by_name = {case.name: case for case in all_cases()}
    report = {}
    for arch, names in cases.items():
        for name in names:
            for launch in capture(DEVICES[arch], by_name[name].run, name).launches:
                if "preprocess" in launch.kernel:
                    continue
                swaps, applies, problems = layout_problems(ttgir_of_launch(launch))
                report[f"{arch} / {name} / {launch.kernel}"] = {"swaps": swaps, "applies": applies,
                                                                 "problems": problems}  # fmt: skip
    return report


def test_lane_swap_and_packed_apply_see_the_layouts_they_assume():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_philox_layout"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert not {kernel: r["problems"] for kernel, r in report.items() if r["problems"]}
    # every kernel applies dropout, and on sm_90 the tiles with two 16-blocks to share out
    # (all but the masked ones at d128 and d256, and varlen's 16-query dK/dV tiles at d128)
    # swap: nothing passes by checking nothing
    assert all(r["applies"] for r in report.values()), report
    swaps = {kernel: r["swaps"] for kernel, r in report.items() if kernel.startswith("sm90")}
    unswapped = {k for k, n in swaps.items() if not n}
    single_block = "sm90 / attn d128 bf16 s512 varlen dropout0.1 / _attention_bwd_dkdv_kernel"
    assert len(swaps) == 31 and len(unswapped) <= 6, swaps
    assert all("key-padding" in k or k == single_block for k in unswapped), unswapped


if __name__ == "__main__":
    print(json.dumps(compile_and_check(CASES)))
