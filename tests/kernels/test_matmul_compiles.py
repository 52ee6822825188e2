"""The GEMM and quantization kernels compile for Hopper (sm_90) in every tuned config."""

import pytest

from slimformer.kernels import matmul
from tests.aot_compile import KernelBuild, compile_for_hopper

MODULE = "slimformer.kernels.matmul"
SHAPE_ARGS = {"M": "i32", "N": "i32", "K": "i32", "M_BUCKET": "i32"}
# (X, W, X_SCALE, W_SCALE, Y) pointer types per GEMM kind and activation dtype.
GEMM_POINTERS = {
    ("float", "fp16"): ("*fp16", "*fp16", None, None, "*fp16"),
    ("float", "bf16"): ("*bf16", "*bf16", None, None, "*bf16"),
    ("float32", "fp32"): ("*fp32", "*fp32", None, None, "*fp32"),
    ("w8a8", "fp16"): ("*i8", "*i8", "*fp32", "*fp32", "*fp16"),
    ("w8a8", "bf16"): ("*i8", "*i8", "*fp32", "*fp32", "*bf16"),
    ("w8a16", "fp16"): ("*fp16", "*i8", None, "*fp32", "*fp16"),
    ("w8a16", "bf16"): ("*bf16", "*i8", None, "*fp32", "*bf16"),
}


def _gemm_build(kind, dtype, config, activation, bias):
    x, w, x_scale, w_scale, y = GEMM_POINTERS[kind, dtype]
    pointers = {"X": x, "W": w, "X_SCALE": x_scale, "W_SCALE": w_scale, "BIAS": "*fp32" if bias else None, "Y": y}
    return KernelBuild(
        MODULE,
        "_gemm_kernel",
        {name: ptr for name, ptr in pointers.items() if ptr is not None} | SHAPE_ARGS,
        {name: None for name, ptr in pointers.items() if ptr is None}
        | {"ACTIVATION": activation, "UPCAST": False}
        | config.kwargs,
        config.num_warps,
    )


def _builds(kind, dtype, configs):
    activations = ["gelu", "relu", "none"]
    return [_gemm_build(kind, dtype, c, activations[i % 3], bias=i % 2 == 0) for i, c in enumerate(configs)]


@pytest.mark.parametrize("kind", list(matmul.GPU_CONFIGS))
def test_every_gemm_config_compiles_for_sm90(kind):
    dtype = "fp32" if kind == "float32" else "fp16"
    compile_for_hopper(_builds(kind, dtype, matmul.GPU_CONFIGS[kind] + [matmul.INTERPRETER_CONFIG]))


def test_gemm_compiles_for_sm90_in_bf16():
    # Other dtypes change only the loads, the dot's operand type and the store: one config each.
    kinds = [kind for kind in matmul.GPU_CONFIGS if kind != "float32"]
    builds = [b for kind in kinds for b in _builds(kind, "bf16", matmul.GPU_CONFIGS[kind][1:2])]
    compile_for_hopper(builds)


def test_quantize_kernel_compiles_for_sm90():
    builds = []
    for n_cols, x_type, smooth in [(1, "*fp32", False), (384, "*fp16", True), (4096, "*bf16", False),
                                   (16384, "*fp16", True)]:  # fmt: skip
        block_m, block_k, num_warps = matmul._quantize_block(n_cols)
        signature = {"X": x_type, "Q": "*i8", "SCALE": "*fp32", "M": "i32", "K": "i32"}
        builds.append(
            KernelBuild(
                MODULE,
                "_quantize_rows_kernel",
                signature | ({"SMOOTH": "*fp32"} if smooth else {}),
                {"BLOCK_M": block_m, "BLOCK_K": block_k, "ONE_BLOCK": block_k >= n_cols}
                | ({} if smooth else {"SMOOTH": None}),
                num_warps,
            )
        )
    compile_for_hopper(builds)
