"""The activation kernels compile for Hopper (sm_90) in every specialisation."""

import pytest

from slimformer.kernels import activation
from tests.aot_compile import KernelBuild, compile_for_hopper

MODULE = "slimformer.kernels.activation"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kernels_compile_for_sm90(dtype):
    _, block_m, block_n = activation._grid(4096, 3072)
    ptr = f"*{dtype}"
    scalars = {"M": "i32", "N": "i32", "dropout_p": "fp32"}
    builds = []
    for activation_id in range(len(activation.ACTIVATIONS)):
        for seed in ("*i64", None):
            optional = {"SEED": seed} if seed else {}
            absent = {} if seed else {"SEED": None}
            constexprs = {"ACTIVATION": activation_id, "BLOCK_M": block_m, "BLOCK_N": block_n, **absent}
            builds.append(
                KernelBuild(MODULE, "_activation_fwd_kernel", {"H": ptr, "OUT": ptr, **scalars, **optional}, constexprs, 4)
            )
            builds.append(
                KernelBuild(
                    MODULE, "_activation_bwd_kernel", {"DA": ptr, "H": ptr, "DH": ptr, **scalars, **optional}, constexprs, 4
                )
            )
    compile_for_hopper(builds)
