"""The norm kernels compile for Hopper (sm_90) in the specialisations the launchers use."""

import pytest

from slimformer.kernels import norm
from tests.aot_compile import KernelBuild, compile_for_hopper

TYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
MODULE = "slimformer.kernels.norm"


def _builds(n_cols, dtype, fused):
    block_m, block_n, num_warps = norm._block_config(n_cols)
    ptr = f"*{TYPE_NAMES[dtype]}"
    blocks = {"BLOCK_M": block_m, "BLOCK_N": block_n}
    fwd_optional = {"RESIDUAL": ptr, "W": ptr, "B": ptr, "H": ptr, "MEAN": "*fp32", "SEED": "*i64"}
    bwd_optional = {"W": ptr, "B": ptr, "MEAN": "*fp32", "DH_OUT": ptr, "DRESIDUAL": ptr,
                    "DW_PARTIAL": "*fp32", "DB_PARTIAL": "*fp32", "SEED": "*i64"}  # fmt: skip
    forward = KernelBuild(
        MODULE,
        "_norm_fwd_kernel",
        {"X": ptr, "Y": ptr, "RSTD": "*fp32", "M": "i32", "N": "i32", "eps": "fp32", "dropout_p": "fp32",
         **(fwd_optional if fused else {})},
        {"IS_RMS": False, "ROUND_H": fused, "STORE_H": fused, **blocks,
         **({} if fused else dict.fromkeys(fwd_optional))},
        num_warps,
        {"H_DTYPE": dtype},
    )  # fmt: skip
    backward = KernelBuild(
        MODULE,
        "_norm_bwd_kernel",
        {"DY": ptr, "SAVED": ptr, "RSTD": "*fp32", "DX": ptr, "M": "i32", "N": "i32", "dropout_p": "fp32",
         "rows_per_program": "i32", **(bwd_optional if fused else {})},
        {"IS_RMS": not fused, "REBUILD_FROM_OUTPUT": not fused, **blocks,
         **({} if fused else dict.fromkeys(bwd_optional))},
        num_warps,
    )  # fmt: skip
    return [forward, backward]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_compile_for_sm90(dtype):
    builds = [b for n in (1, 768, 65536) for fused in (False, True) for b in _builds(n, dtype, fused)]
    compile_for_hopper(builds)
