"""Compile Triton kernels ahead of time to sm_90 cubins (triton ships ptxas): no GPU needed.

The interpreter accepts programs the GPU compiler rejects, so tests also prove each
kernel builds for an H100/H200. ``triton.jit`` picks the interpreter at decoration
time, so compilation runs in a fresh process without TRITON_INTERPRET.
"""

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field


@dataclass
class KernelBuild:
    """One specialisation: signature maps argument -> Triton type ("*bf16", "i32", "fp32");
    constexprs maps argument -> value (None for an absent pointer); dtype_constexprs maps
    argument -> Triton dtype name ("bfloat16")."""

    module: str
    kernel: str
    signature: dict
    constexprs: dict
    num_warps: int
    dtype_constexprs: dict = field(default_factory=dict)


def compile_for_hopper(builds: list[KernelBuild]) -> None:
    """Compile every build in one subprocess; raise AssertionError with its stderr on failure."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    payload = json.dumps([asdict(b) for b in builds])
    result = subprocess.run(
        [sys.executable, "-m", "tests.aot_compile"], input=payload, capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, f"sm_90 compilation failed:\n{result.stderr[-4000:]}"


def _compile(build: dict) -> None:
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(build["module"]), build["kernel"])
    constexprs = dict(build["constexprs"])
    constexprs.update({name: getattr(tl, dtype) for name, dtype in build["dtype_constexprs"].items()})
    signature = {name: "constexpr" for name in constexprs} | build["signature"]
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": build["num_warps"]},
    )
    if not compiled.asm.get("cubin"):
        raise RuntimeError(f"{build['kernel']}: ptxas produced no cubin")


if __name__ == "__main__":
    for build in json.load(sys.stdin):
        _compile(build)
