"""The linear + cross-entropy chunk kernels compile for Hopper (sm_90), each logits dtype."""

import pytest

from slimformer.kernels import linear_cross_entropy as lce
from tests.aot_compile import KernelBuild, compile_for_hopper

MODULE = "slimformer.kernels.linear_cross_entropy"


@pytest.mark.parametrize("logits", ["fp32", "fp16", "bf16"])
def test_kernels_compile_for_sm90(logits):
    block_v = {"BLOCK_V": lce._block_v(lce._chunk_width(300, 30522))}
    rows = {"stride_row": "i32", "chunk": "i32", "v_start": "i32"}
    statistics = KernelBuild(
        MODULE,
        "_chunk_statistics_kernel",
        {"LOGITS": f"*{logits}", "LABELS": "*i64", "ROW_MAX": "*fp32", "ROW_SUMEXP": "*fp32", "ROW_SUM": "*fp32",
         "ROW_TARGET": "*fp32", **rows},
        block_v,
        4,
    )  # fmt: skip
    grad = KernelBuild(
        MODULE,
        "_chunk_logits_grad_kernel",
        {"LOGITS": f"*{logits}", "LABELS": "*i64", "LSE": "*fp32", "ROW_GRAD": "*fp32", **rows,
         "target_weight": "fp32", "uniform_weight": "fp32"},
        block_v,
        4,
    )  # fmt: skip
    compile_for_hopper([statistics, grad])
