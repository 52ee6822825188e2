"""slimformer.attention vs an explicit float64 reference, within 2x SDPA's own same-dtype error.

Every CPU test runs twice through the ``backend`` fixture: the interpreted Triton kernels
and the PyTorch reference path. The gpu tests repeat the comparisons on CUDA at long
sequences.
"""

import functools
import itertools
import math
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right, causal_upper_left
from triton.tools.tensor_descriptor import TensorDescriptor

from slimformer.kernels import dispatch
from slimformer.kernels.attention import attention, backward, configs, forward, launch, ops, self_attention
from slimformer.kernels.philox import dropout_keep_mma_block, dropout_threshold, new_dropout_seed
from slimformer.memory import measure_activation_memory
from tests.helpers import assert_within_reference_error

# (dtype, ulps): the absolute slack of assert_within_reference_error, in units in the
# last place. fp32 sums keys in another order than SDPA, whose own fp32 error can be tiny.
FP32_ULPS = 8.0
DTYPES = [
    pytest.param(torch.float32, FP32_ULPS, id="fp32"),
    pytest.param(torch.float16, 1.0, id="fp16"),
    pytest.param(torch.bfloat16, 1.0, id="bf16"),
]
GPU_DTYPES = DTYPES[1:]


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    causal: bool = False
    masks: tuple[str, ...] = ()  # of "padding", "bool", "additive"

    def __str__(self) -> str:
        flags = ("causal",) * self.causal + self.masks
        return "-".join(
            [f"b{self.batch}h{self.heads}kv{self.kv_heads}", f"q{self.seq_q}k{self.seq_k}d{self.head_dim}", *flags]
        )


CASES = [
    Case(1, 1, 1, 1, 1, 16),
    Case(2, 2, 2, 17, 17, 40, causal=True),
    Case(2, 2, 2, 97, 97, 64, masks=("padding",)),
    Case(2, 3, 3, 128, 128, 80, masks=("bool",)),
    Case(1, 2, 2, 200, 200, 128, masks=("additive",)),
    Case(2, 4, 2, 17, 97, 64, causal=True),
    Case(1, 3, 1, 97, 17, 40, causal=True, masks=("padding",)),
    Case(2, 2, 2, 128, 200, 16, causal=True, masks=("padding", "additive")),
    Case(2, 2, 2, 1, 200, 80, masks=("bool",)),
    Case(2, 1, 1, 200, 1, 128, masks=("padding",)),
    Case(1, 2, 1, 33, 40, 256, masks=("padding", "bool")),
]
TINY_CASES = [
    Case(2, heads, kv_heads, seq_q, seq_k, head_dim, causal, masks)
    for (heads, kv_heads), (seq_q, seq_k), head_dim, causal, masks in itertools.product(
        [(2, 2), (2, 1)],
        [(1, 17), (17, 5)],
        [16, 40],
        [False, True],
        [(), ("padding",), ("bool",), ("additive",)],
    )
]
GPU_CASES = [
    Case(2, 8, 8, 1024, 1024, 64, causal=True),
    Case(1, 8, 2, 2048, 2048, 128, masks=("padding",)),
    Case(1, 4, 4, 4096, 4096, 80, causal=True),
    Case(2, 4, 4, 1000, 1537, 256, masks=("additive",)),
    Case(2, 4, 1, 1024, 1024, 40, masks=("bool", "padding")),
    Case(1, 6, 3, 1537, 1024, 96, causal=True, masks=("padding",)),
    Case(1, 4, 4, 1024, 2048, 112, causal=True),
]


def _inputs(case: Case, dtype: torch.dtype, device: str = "cpu"):
    """q, k, v, upstream grad, attn_mask, key_padding_mask; the masks leave some rows with no key."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    b, h, hk, sq, sk, d = case.batch, case.heads, case.kv_heads, case.seq_q, case.seq_k, case.head_dim
    q, k, v, grad = randn(b, h, sq, d), randn(b, hk, sk, d), randn(b, hk, sk, d), randn(b, h, sq, d)
    attn_mask = key_padding_mask = None
    if "bool" in case.masks:
        attn_mask = torch.rand(b, 1, sq, sk, generator=gen) > 0.3
        attn_mask[0, :, 0] = False
        attn_mask = attn_mask.to(device)
    if "additive" in case.masks:
        additive = torch.randn(1, h, sq, sk, generator=gen) * 2
        additive = additive.masked_fill(torch.rand(1, h, sq, sk, generator=gen) < 0.2, -math.inf)
        additive[:, :, -1] = -math.inf
        attn_mask = additive.to(device, dtype)
    if "padding" in case.masks:
        key_padding_mask = torch.zeros(b, sk, dtype=torch.bool)
        key_padding_mask[0, sk - sk // 3 :] = True
        key_padding_mask[1:] = True
        key_padding_mask = key_padding_mask.to(device)
    return q, k, v, grad, attn_mask, key_padding_mask


def _mask_arguments(case: Case, attn_mask) -> tuple[torch.Tensor | None, bool]:
    """(attn_mask, is_causal) to pass for a case: is_causal takes no attn_mask (SDPA's
    rule), so a causal case with a mask has the causal mask folded into it."""
    if not case.causal or attn_mask is None:
        return attn_mask, case.causal
    future = torch.ones(case.seq_q, case.seq_k, dtype=torch.bool, device=attn_mask.device).triu(1)
    if attn_mask.dtype == torch.bool:
        return attn_mask & ~future, False
    return attn_mask.masked_fill(future, -math.inf), False


def _bias(case: Case, attn_mask, key_padding_mask, device: str = "cpu") -> torch.Tensor:
    """All of a case's masks as one additive fp32 mask of shape (batch, heads, seq_q, seq_k)."""
    bias = torch.zeros(case.batch, case.heads, case.seq_q, case.seq_k, device=device)
    if attn_mask is not None:
        bias = bias.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else bias + attn_mask.float()
    if key_padding_mask is not None:
        bias = bias.masked_fill(key_padding_mask[:, None, None, :], -math.inf)
    if case.causal:
        future = torch.ones(case.seq_q, case.seq_k, dtype=torch.bool, device=device).triu(1)
        bias = bias.masked_fill(future, -math.inf)
    return bias


def _reference(q, k, v, bias, dropout_scale=None):
    """Explicit attention in q's dtype with a softmax in at least fp32; rows with no
    allowed key give 0. In float64 it is the exact result the kernels are held to."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.mT).to(torch.promote_types(q.dtype, torch.float32)) / math.sqrt(q.shape[-1]) + bias
    has_key = (s > -math.inf).any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~has_key, 0.0), dim=-1) * has_key
    if dropout_scale is not None:
        p = p * dropout_scale
    return p.to(v.dtype) @ v


def _forward_backward(fn, q, k, v, grad):
    """fn(q, k, v) and its gradients for ``grad``, all detached: (out, dq, dk, dv)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _check_case(case: Case, dtype: torch.dtype, ulps: float, device: str, deterministic: bool = True) -> None:
    q, k, v, grad, attn_mask, key_padding_mask = _inputs(case, dtype, device)
    bias = _bias(case, attn_mask, key_padding_mask, device)
    attn_mask, is_causal = _mask_arguments(case, attn_mask)
    got = _forward_backward(
        lambda q, k, v: attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=is_causal,
            enable_gqa=True,
            key_padding_mask=key_padding_mask,
            deterministic=deterministic,
        ),
        q,
        k,
        v,
        grad,
    )
    exact = _forward_backward(
        lambda q, k, v: _reference(q, k, v, bias.double()), q.double(), k.double(), v.double(), grad.double()
    )
    sdpa = _forward_backward(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(dtype), enable_gqa=True),
        q,
        k,
        v,
        grad,
    )
    for name, actual, same_dtype, reference in zip(("out", "dq", "dk", "dv"), got, sdpa, exact):
        assert_within_reference_error(name, actual, same_dtype.nan_to_num(), reference, ulps)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_matches_reference(backend, dtype, ulps, case):
    _check_case(case, dtype, ulps, "cpu")


@pytest.mark.parametrize("case", TINY_CASES, ids=str)
def test_matches_reference_every_combination(backend, case):
    _check_case(case, torch.float32, FP32_ULPS, "cpu")


# Longer than the 16-bit blocks and not a multiple of them: the kernels' unmasked
# middle blocks, the causal diagonal blocks and the partial last blocks all run.
BLOCK_SPLIT_CASES = [
    Case(1, 2, 1, 300, 300, 64, causal=True),
    Case(1, 1, 1, 150, 270, 64),
    Case(1, 1, 1, 270, 150, 128, causal=True, masks=("padding",)),
]


@pytest.mark.parametrize("case", BLOCK_SPLIT_CASES, ids=str)
def test_unmasked_and_edge_blocks_match_reference(backend, case):
    _check_case(case, torch.float16, 1.0, "cpu")


# deterministic=False: dQ added with atomics by the dK/dV kernel. Odd sizes, GQA, causal,
# every mask kind; the 16-bit cases run several key blocks per query block (the 16-bit
# blocks' sizes), so several programs add into each dQ row.
ATOMIC_DQ_CASES = [
    Case(2, 4, 2, 17, 97, 64, causal=True),
    Case(1, 3, 1, 97, 17, 40, causal=True, masks=("padding",)),
    Case(2, 2, 2, 1, 200, 80, masks=("bool",)),
    Case(1, 2, 1, 33, 40, 256, masks=("padding", "bool")),
    Case(1, 2, 2, 150, 270, 64, masks=("additive",)),
    Case(1, 2, 1, 300, 300, 64, causal=True),
]


@pytest.mark.parametrize("case", ATOMIC_DQ_CASES, ids=str)
@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_atomic_dq_matches_reference(backend, dtype, ulps, case):
    _check_case(case, dtype, ulps, "cpu", deterministic=False)


@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_atomic_dq_with_dropout_uses_the_same_mask(backend, dtype, ulps):
    _check_dropout(Case(2, 2, 1, 97, 70, 40, causal=True, masks=("padding",)), dtype, ulps, "cpu", deterministic=False)


def test_atomic_dq_skips_the_dq_kernel(backend, monkeypatch):
    """deterministic=False computes dQ without the second pass (its kernel is never launched)."""
    monkeypatch.setattr(backward, "_attention_bwd_dq_kernel", None)
    q, k, v, grad, _, _ = _inputs(Case(1, 2, 2, 40, 40, 16), torch.float32)
    got = _forward_backward(lambda q, k, v: attention(q, k, v, deterministic=False), q, k, v, grad)
    exact = _forward_backward(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v, grad)
    for name, actual, reference in zip(("out", "dq", "dk", "dv"), got, exact):
        torch.testing.assert_close(actual, reference, msg=name)


def test_self_attention_atomic_dq_matches_deterministic(backend):
    x, weight = torch.randn(2, 37, 64), torch.randn(192, 64) / 8
    grads = []
    for deterministic, recompute_qkv in ((True, False), (False, False), (False, True)):
        x_ = x.clone().requires_grad_()
        self_attention(
            x_, weight, None, 4, is_causal=True, recompute_qkv=recompute_qkv, deterministic=deterministic
        ).sum().backward()
        grads.append(x_.grad)
    for grad in grads[1:]:
        torch.testing.assert_close(grad, grads[0], rtol=1e-5, atol=1e-5)


def test_negative_scale_matches_sdpa(backend):
    """Unmasked blocks take the row max from min(q·k) when the scale is negative."""
    q, k, v, grad, _, _ = _inputs(Case(1, 1, 1, 150, 150, 64), torch.float32)
    got = _forward_backward(lambda q, k, v: attention(q, k, v, scale=-0.2), q, k, v, grad)
    exact = _forward_backward(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=-0.2),
        q.double(),
        k.double(),
        v.double(),
        grad.double(),
    )
    same_dtype = _forward_backward(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=-0.2), q, k, v, grad)
    for name, actual, ours, reference in zip(("out", "dq", "dk", "dv"), got, same_dtype, exact):
        assert_within_reference_error(name, actual, ours, reference, FP32_ULPS)


# The forward's sm_90 path for unmasked launches: q, k, v through TMA descriptors, whose
# copy engine zero-fills rows past seq and columns past head_dim (80 in a 128-wide block).
TMA_CASES = [
    (Case(2, 4, 2, 150, 97, 64, causal=True), 0.0),
    (Case(1, 2, 2, 130, 200, 80), 0.0),
    (Case(2, 2, 1, 97, 70, 40, causal=True), 0.25),
]


@pytest.mark.parametrize("case, dropout_p", TMA_CASES, ids=str)
def test_tma_descriptor_loads_match_reference(monkeypatch, case, dropout_p):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter stands in for a device with TMA")
    monkeypatch.setattr(launch, "tma_supported", lambda x: True)
    made = []
    monkeypatch.setattr(forward, "tma_descriptors", lambda *a: made.append(launch.tma_descriptors(*a)) or made[-1])
    if dropout_p:
        _check_dropout(case, torch.float16, 1.0, "cpu", dropout_p)
    else:
        _check_case(case, torch.float16, 1.0, "cpu")
    assert made and all(d is not None for d in made)


def test_tma_only_where_the_copy_engine_can_read_the_tensors(monkeypatch):
    monkeypatch.setattr(launch, "tma_supported", lambda x: True)
    qkv = torch.zeros(2, 17, 3 * 4 * 40, dtype=torch.bfloat16)
    fused = ops.split_heads(qkv, 4)
    descriptors = launch.tma_descriptors(fused, (128, 64, 64), 64)
    for descriptor, x, rows in zip(
        descriptors, fused, (128, 64, 64), strict=True
    ):  # as Triton's constructor makes them
        made = TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, 64])
        assert descriptor.base is x and type(descriptor) is TensorDescriptor
        assert {k: v for k, v in vars(descriptor).items() if k != "base"} == {
            k: v for k, v in vars(made).items() if k != "base"
        }
    assert launch.tma_descriptors([x.float() for x in fused], (32, 32, 32), 64) is None
    misaligned = torch.zeros(2 * 17 * 3 * 160 + 1, dtype=torch.bfloat16)[1:].view(2, 17, 480)
    assert launch.tma_descriptors(ops.split_heads(misaligned, 4), (128, 64, 64), 64) is None
    odd_rows = torch.zeros(2, 4, 17, 36, dtype=torch.bfloat16)  # 72-byte rows
    assert launch.tma_descriptors([odd_rows], (64,), 64) is None
    broadcast = torch.zeros(2, 1, 17, 64, dtype=torch.bfloat16).expand(2, 4, 17, 64)
    assert launch.tma_descriptors([broadcast], (64,), 64) is None
    monkeypatch.setattr(launch, "tma_supported", lambda x: False)
    assert launch.tma_descriptors(fused, (128, 64, 64), 64) is None


def test_grid_takes_any_batch():
    """One grid axis of up to 2^31 - 1 programs: a batch past CUDA's 65,535 (axis z) launches."""
    assert launch.grid(4, 12, 100_000) == (4_800_000,)
    with pytest.raises(ValueError, match="split the batch"):
        launch.grid(2**16, 2**10, 2**6)


@pytest.mark.parametrize(
    "strides, unit", [([(72, 72, 72, 1)], 8), ([(40 * 3, 40, 120 * 7, 1), (64, 64, 64, 1)], 8), ([(20, 4, 2, 1)], 2)]
)
def test_stride_unit_is_the_largest_dividing_every_row_stride(strides, unit):
    tensors = [torch.empty(1).as_strided((1, 1, 1, 1), stride) for stride in strides]
    assert launch.stride_unit(*tensors) == unit


SM90_SHARED, SM80_SHARED, SM86_SHARED = 227 * 1024, 163 * 1024, 99 * 1024


def test_compute_capability_picks_the_block_config_table():
    """sm_80 / 8.x devices with 163 KB of shared memory take their own table (mma.sync),
    devices with 99 KB (8.6, 8.9) the 99 KB one; CPU tensors and everything else the sm_90
    one; fp32 one config everywhere but at d256 with 99 KB."""
    sm80, sm90, small = configs.SM80.tensor_core, configs.SM90.tensor_core, configs.SMALL_SHARED.tensor_core
    block_config = configs.block_config
    assert dispatch.device_target(torch.zeros(1)) == (90, SM90_SHARED)
    devices = ((80, SM80_SHARED, sm80), (87, SM80_SHARED, sm80), (86, SM86_SHARED, small), (89, SM86_SHARED, small),
               (90, SM90_SHARED, sm90), (100, SM90_SHARED, sm90))  # fmt: skip
    for arch, shared, table in devices:
        for kernel, rows in table.items():
            for largest, *row_configs in rows:
                # the row's largest head dim and one just above the row before (d40: the d64 row)
                for head_dim in (largest, max(16, largest // 2 + 8)):
                    for kind, config in zip(configs.CONFIG_KINDS, row_configs):
                        got = block_config(head_dim, torch.bfloat16, kernel, kind, arch, shared)
                        assert (got["BLOCK_M"], got["BLOCK_N"], got["num_warps"], got["num_stages"]) == config
                        fp32 = block_config(head_dim, torch.float32, kernel, kind, arch, shared)
                        if shared >= SM80_SHARED or largest < 256:
                            assert fp32 == block_config(head_dim, torch.float32, kernel, kind)
                        else:
                            assert (fp32["BLOCK_M"], fp32["BLOCK_N"], fp32["num_warps"]) == (16, 16, 4)


def test_99kb_table_is_sm80s_but_where_measured_on_sm86():
    """The 99 KB table is sm_80's but for the d256 forward and dQ without masks, whose
    sm_80 configs need 100 KB, and the d64 dQ with dropout, which spills compiled for sm_86
    (python -m tools.compile_report --arch sm86)."""
    sm80, small = configs.SM80.tensor_core, configs.SMALL_SHARED.tensor_core
    assert small.keys() == sm80.keys()
    changed = {
        (kernel, row[0], kind)
        for kernel in sm80
        for row, sm80_row in zip(small[kernel], sm80[kernel], strict=True)
        for kind, config, sm80_config in zip(configs.CONFIG_KINDS, row[1:], sm80_row[1:])
        if config != sm80_config
    }
    assert changed == {
        ("fwd", 256, "plain"),
        ("fwd", 256, "dropout"),
        ("dq", 256, "plain"),
        ("dq", 256, "dropout"),
        ("dq", 64, "dropout"),
    }


def _fake_cuda_tensor(monkeypatch, capability: tuple[int, int], shared_bytes: int):
    """A stand-in for a CUDA tensor on a device of ``capability`` with ``shared_bytes`` per
    block, as far as the launchers' device queries see it (no GPU needed)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # a cache of its own: dispatch reads a device's properties once
    monkeypatch.setattr(dispatch, "_cuda_target", functools.cache(dispatch._cuda_target.__wrapped__))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    properties = SimpleNamespace(shared_memory_per_block_optin=shared_bytes, major=capability[0], minor=capability[1])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), get_device=lambda: 0)


@pytest.mark.parametrize(
    "capability, shared_bytes, table",
    [
        ((8, 0), SM80_SHARED, "SM80"),
        ((8, 6), SM86_SHARED, "SMALL_SHARED"),
        ((8, 9), SM86_SHARED, "SMALL_SHARED"),
        ((9, 0), SM90_SHARED, "SM90"),
    ],
    ids=["sm80", "sm86", "sm89", "sm90"],
)
def test_device_queries_pick_the_table(monkeypatch, capability, shared_bytes, table):
    """The launchers' device query (capability and opt-in shared memory per block) picks the
    table, here for devices faked through torch.cuda's own queries."""
    x = _fake_cuda_tensor(monkeypatch, capability, shared_bytes)
    arch, shared = dispatch.device_target(x)
    assert (arch, shared) == (capability[0] * 10 + capability[1], shared_bytes)
    assert configs.config_table(arch, shared) is getattr(configs, table)
    if shared_bytes < SM80_SHARED:
        config = configs.block_config(256, torch.bfloat16, "fwd", "plain", arch, shared)
        assert (config["BLOCK_M"], config["BLOCK_N"], config["num_warps"], config["num_stages"]) == (32, 32, 4, 3)


# sm_80's block configs run the same kernels on other tiles: interpreted, with the table
# forced (CPU launches take sm_90's), they give the same results.
SM80_CASES = [
    Case(1, 2, 1, 150, 150, 64, causal=True),
    Case(1, 1, 1, 150, 170, 128, masks=("padding", "bool")),
    Case(1, 1, 1, 40, 70, 256, causal=True),
]


@pytest.mark.parametrize("case", SM80_CASES, ids=str)
def test_sm80_block_configs_match_reference(backend, monkeypatch, case):
    monkeypatch.setattr(dispatch, "device_target", lambda _tensor: dispatch.DeviceTarget(80, SM80_SHARED))
    _check_case(case, torch.float16, 1.0, "cpu")


def test_sm80_block_configs_dropout_match_reference(backend, monkeypatch):
    monkeypatch.setattr(dispatch, "device_target", lambda _tensor: dispatch.DeviceTarget(80, SM80_SHARED))
    _check_dropout(Case(1, 2, 1, 97, 70, 64, causal=True), torch.float16, 1.0, "cpu")


# The 99 KB table's own configs (d256 forward and dQ, fp32 at d256, the forward and dQ
# with dropout), interpreted with the table forced, give the same results.
@pytest.mark.parametrize("dtype, ulps", [DTYPES[0], DTYPES[1]])
def test_99kb_block_configs_match_reference(backend, monkeypatch, dtype, ulps):
    monkeypatch.setattr(dispatch, "device_target", lambda _tensor: dispatch.DeviceTarget(86, SM86_SHARED))
    _check_case(Case(1, 1, 1, 40, 70, 256, causal=True), dtype, ulps, "cpu")


@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_99kb_block_configs_dropout_match_reference(backend, monkeypatch, head_dim):
    monkeypatch.setattr(dispatch, "device_target", lambda _tensor: dispatch.DeviceTarget(86, SM86_SHARED))
    _check_dropout(Case(1, 1, 1, 40, 70, head_dim, causal=True), torch.float16, 1.0, "cpu")


@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, -1e9, -1e5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_masked_by_large_finite_values_count_as_fully_masked(backend, dtype, fill):
    # Row 2 is masked everywhere by a finite additive value, row 4 at three of its keys.
    # Row 2 gives zeros and no gradient (its lse would not fit in fp32: SDPA averages v
    # there); every other row, and every key's gradient, is SDPA's with row 2's dO = 0.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen, dtype=torch.float64) for n in (6, 5, 5))
    grad = torch.randn(1, 2, 6, 16, generator=gen, dtype=torch.float64)
    mask = torch.zeros(1, 2, 6, 5, dtype=torch.float64)
    mask[:, :, 2, :] = fill
    mask[:, :, 4, 1:4] = fill
    got = _forward_backward(
        lambda q, k, v: attention(q, k, v, attn_mask=mask.to(dtype)), *(x.to(dtype) for x in (q, k, v, grad))
    )
    row_masked = grad.clone()
    row_masked[:, :, 2] = 0
    valid = mask.masked_fill(mask <= -1e5, -math.inf)
    exact = _forward_backward(lambda q, k, v: _reference(q, k, v, valid), q, k, v, row_masked)
    assert torch.equal(got[0][:, :, 2], torch.zeros_like(got[0][:, :, 2]))
    assert torch.equal(got[1][:, :, 2], torch.zeros_like(got[1][:, :, 2]))
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for name, actual, expected in zip(("out", "dq", "dk", "dv"), got, exact):
        torch.testing.assert_close(actual.double(), expected, rtol=tolerance, atol=tolerance, msg=name)


def test_autocast_casts_inputs_like_sdpa(backend):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 7, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 9, 16, generator=gen).to(torch.bfloat16).requires_grad_(True)
    v = torch.randn(2, 2, 9, 16, generator=gen, requires_grad=True)
    results = []
    for fn in (attention, F.scaled_dot_product_attention):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(q, k, v)
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
        results.append((out, grads))
    (out, grads), (out_ref, grads_ref) = results
    assert out.dtype == out_ref.dtype == torch.bfloat16
    assert [g.dtype for g in grads] == [torch.float32, torch.bfloat16, torch.float32]
    torch.testing.assert_close(out, out_ref, rtol=2e-2, atol=2e-2)  # bf16 inputs: a few bf16 ulps
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=5e-2, atol=5e-2)


def _keep(shape, p, device) -> torch.Tensor:
    """The (batch, heads, seq_q, seq_k) mask drawn from torch's next seed: stream
    b · heads + h of the attention scheme, element (i, j)."""
    seed = new_dropout_seed(torch.device(device))
    batch_heads, seq_q, seq_k = math.prod(shape[:-2]), shape[-2], shape[-1]
    return dropout_keep_mma_block(seed, batch_heads, 0, seq_q, seq_k, seq_k, p).view(shape)


def _check_dropout(
    case: Case, dtype: torch.dtype, ulps: float, device: str, p: float = 0.25, deterministic: bool = True
) -> None:
    q, k, v, grad, attn_mask, key_padding_mask = _inputs(case, dtype, device)
    bias = _bias(case, attn_mask, key_padding_mask, device)
    attn_mask, is_causal = _mask_arguments(case, attn_mask)
    torch.manual_seed(1234)
    got = _forward_backward(
        lambda q, k, v: attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=p,
            is_causal=is_causal,
            enable_gqa=True,
            key_padding_mask=key_padding_mask,
            deterministic=deterministic,
        ),
        q,
        k,
        v,
        grad,
    )
    torch.manual_seed(1234)
    dropout_scale = _keep(bias.shape, p, device) * dropout_threshold(p)[1]
    exact = _forward_backward(
        lambda q, k, v: _reference(q, k, v, bias.double(), dropout_scale.double()),
        q.double(),
        k.double(),
        v.double(),
        grad.double(),
    )
    same_dtype = _forward_backward(lambda q, k, v: _reference(q, k, v, bias, dropout_scale), q, k, v, grad)
    for name, *tensors in zip(("out", "dq", "dk", "dv"), got, same_dtype, exact):
        assert_within_reference_error(name, *tensors, ulps)


@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_dropout_forward_and_gradient_use_the_same_mask(backend, dtype, ulps):
    # odd lengths (partial blocks), grouped heads (2 per key/value head), causal, padding
    _check_dropout(Case(2, 2, 1, 97, 70, 40, causal=True, masks=("padding",)), dtype, ulps, "cpu")


@pytest.mark.parametrize("deterministic", [True, False])
def test_grouped_dropout_at_d128_takes_its_own_tiles(monkeypatch, deterministic):
    # GQA's dK/dV launches with dropout at head dims over 64 take 16 query rows a step
    # (ConfigTable.grouped_dropout): the same gradients, through the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launched = []

    def recorded(*args, **kwargs):
        launched.append(configs.block_config(*args, **kwargs))
        return launched[-1]

    monkeypatch.setattr(backward, "block_config", recorded)
    _check_dropout(Case(1, 2, 1, 40, 33, 128, causal=True), torch.float16, 1.0, "cpu", deterministic=deterministic)
    assert {(c["BLOCK_M"], c["BLOCK_D"]) for c in launched if c["BLOCK_N"] == 128} >= {(16, 128)}, launched


@pytest.mark.parametrize(
    "case",
    [Case(2, 4, 2, 37, 29, 16, causal=True, masks=("padding", "bool")), Case(1, 3, 3, 23, 41, 24, masks=("additive",))],
    ids=str,
)
def test_reference_in_small_query_blocks_matches(monkeypatch, case):
    # The PyTorch reference walks over blocks of query rows; with blocks of a few rows
    # (7 here, one at the smaller budget) every block boundary, the causal key limit per
    # block and the per-block dropout rows are exercised against one-block runs.
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def run(block_scores):
        monkeypatch.setattr(dispatch, "REFERENCE_BLOCK_ELEMENTS", block_scores)
        torch.manual_seed(5)
        return _forward_backward(
            lambda q, k, v: attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=0.2,
                is_causal=is_causal,
                enable_gqa=True,
                key_padding_mask=key_padding_mask,
            ),
            q,
            k,
            v,
            grad,
        )

    q, k, v, grad, attn_mask, key_padding_mask = _inputs(case, torch.float32)
    attn_mask, is_causal = _mask_arguments(case, attn_mask)
    whole = run(2**30)
    for block_scores in (7 * case.batch * case.heads * case.seq_k, 1):
        for name, blocked, one_block in zip(("out", "dq", "dk", "dv"), run(block_scores), whole):
            torch.testing.assert_close(blocked, one_block, rtol=1e-5, atol=1e-6, msg=name)


def test_dropout_mask_is_philox_of_torch_seed(backend):
    # With q = k = 0 every key gets weight 1/seq_k, and v = I lays each row's keep
    # decisions out in the output: out[..., i, j] = keep_ij · scale / seq_k.
    batch, heads, seq_q, seq_k, p = 1, 2, 64, 128, 0.3
    q = torch.zeros(batch, heads, seq_q, seq_k)
    k = torch.zeros(batch, heads, seq_k, seq_k)
    v = torch.eye(seq_k).expand(batch, heads, seq_k, seq_k)
    torch.manual_seed(7)
    out = attention(q, k, v, dropout_p=p)
    torch.manual_seed(7)
    expected = _keep(out.shape, p, q.device)
    kept = out / dropout_threshold(p)[1] * seq_k
    assert torch.allclose(kept, expected.float(), atol=1e-5)
    assert abs(kept.mean().item() - (1 - p)) < 0.02


def test_dropout_reproducible_from_torch_seed(backend):
    q, k, v, grad, _, _ = _inputs(Case(1, 2, 2, 40, 40, 16), torch.float32)

    def run():
        return _forward_backward(lambda q, k, v: attention(q, k, v, dropout_p=0.5), q, k, v, grad)

    torch.manual_seed(3)
    first = run()
    torch.manual_seed(3)
    second = run()
    third = run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], third[0])


@pytest.mark.parametrize(
    "q_shape, kv_shape",
    [((0, 2, 5, 16), (0, 2, 7, 16)), ((1, 2, 0, 16), (1, 2, 7, 16)), ((1, 2, 5, 16), (1, 2, 0, 16))],
    ids=["batch0", "seq_q0", "seq_k0"],
)
def test_empty_inputs_give_zeros(backend, q_shape, kv_shape):
    q = torch.randn(q_shape, requires_grad=True)
    k, v = torch.randn(kv_shape, requires_grad=True), torch.randn(kv_shape, requires_grad=True)
    out = attention(q, k, v)
    out.sum().backward()
    assert out.shape == q_shape and not out.any()
    assert q.grad.shape == q_shape and not q.grad.any()
    assert k.grad.shape == kv_shape and not k.grad.any() and not v.grad.any()


def _sdpa_and_ours(q, k, v, grad, **kwargs):
    """(ours, SDPA's math path): each (out, dq, dk, dv) for the same inputs and kwargs."""
    with sdpa_kernel(SDPBackend.MATH):
        sdpa = _forward_backward(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs), q, k, v, grad)
    return _forward_backward(lambda q, k, v: attention(q, k, v, **kwargs), q, k, v, grad), sdpa


def _poisoned(where: str):
    """Small inputs with one NaN or inf placed where ``where`` says, and attention's kwargs."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 16, generator=gen) for n in (7, 9, 9))
    grad = torch.randn(2, 2, 7, 16, generator=gen)
    mask = torch.randn(2, 1, 7, 9, generator=gen)
    kwargs = {"attn_mask": mask}
    if where == "q_nan":
        q[0, 1, 3, 5] = math.nan
    elif where == "k_inf":
        k[1, 0, 4, 2] = math.inf
    elif where == "v_nan":
        v[0, 0, 6, 7] = math.nan
    elif where == "scale_nan":
        kwargs["scale"] = math.nan
    elif where == "scale_inf":
        kwargs["scale"] = math.inf
    elif where == "mask_nan":
        mask[1, 0, 2, 3] = math.nan
    elif where == "mask_inf":
        mask[0, 0, 5, 1] = math.inf
    return q, k, v, grad, kwargs


@pytest.mark.parametrize("where", ["q_nan", "k_inf", "v_nan", "scale_nan", "scale_inf", "mask_nan", "mask_inf"])
def test_nan_and_inf_propagate_like_sdpa(backend, where):
    q, k, v, grad, kwargs = _poisoned(where)
    ours, sdpa = _sdpa_and_ours(q, k, v, grad, **kwargs)
    assert not sdpa[0].isfinite().all(), "the case must poison SDPA's output"
    for name, got, expected in zip(("out", "dq", "dk", "dv"), ours, sdpa):
        assert torch.equal(got.isnan(), expected.isnan()), f"{name}: NaNs where SDPA has none, or none where it has"
        finite = expected.isfinite()
        torch.testing.assert_close(got[finite], expected[finite], msg=name)


def test_nan_in_additive_mask_is_not_masked(backend):
    # a row whose only finite-or-NaN keys are NaN is not a "fully masked" row of zeros
    q, k, v = torch.randn(1, 1, 3, 16), torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16)
    mask = torch.full((3, 4), -math.inf)
    mask[:, 0] = 0.0
    mask[1] = math.nan
    out = attention(q, k, v, attn_mask=mask)
    assert out[0, 0, 1].isnan().all() and out[0, 0, [0, 2]].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_negative_scores_are_not_a_masked_row(backend, dtype):
    # Every score is about -1e5 (q > 0, k < 0, scale 2e4), far below any lse threshold,
    # yet nothing is masked: SDPA gives (close to) the best key's v, not zeros.
    gen = torch.Generator().manual_seed(0)
    q = (torch.rand(1, 2, 5, 16, generator=gen) + 0.1).to(dtype)
    k = -(torch.rand(1, 2, 6, 16, generator=gen) + 0.1).to(dtype)
    v = torch.randn(1, 2, 6, 16, generator=gen).to(dtype)
    grad = torch.randn(1, 2, 5, 16, generator=gen).to(dtype)
    ours, sdpa = _sdpa_and_ours(q, k, v, grad, scale=2e4)
    assert (q.float() @ k.float().mT * 2e4).amax() < -(2.0**16)
    assert sdpa[0].abs().amax() > 0.1
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(ours[0], sdpa[0], rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(ours[3], sdpa[3], rtol=tolerance, atol=tolerance)


def test_zero_heads_give_an_empty_result_like_sdpa(backend):
    q, k, v = torch.randn(2, 0, 8, 16, requires_grad=True), torch.randn(2, 0, 9, 16), torch.randn(2, 0, 9, 16)
    out = attention(q, k, v)
    out.sum().backward()
    assert out.shape == F.scaled_dot_product_attention(q, k, v).shape == (2, 0, 8, 16)
    assert q.grad.shape == (2, 0, 8, 16)


@pytest.mark.parametrize("masks", ["additive+padding", "causal+padding"])
def test_float64_runs_the_reference_and_passes_gradcheck(backend, masks):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64, requires_grad=True) for n in (5, 6, 6))
    padding = torch.tensor([[False, False, False, False, True, True]])
    bias = torch.zeros(5, 6, dtype=torch.float64).masked_fill(padding[0], -math.inf)
    if masks == "causal+padding":
        kwargs = dict(is_causal=True, key_padding_mask=padding)
        bias = bias.masked_fill(torch.ones(5, 6).triu(1).bool(), -math.inf)
    else:
        mask = torch.randn(5, 6, generator=gen, dtype=torch.float64)
        kwargs = dict(attn_mask=mask, key_padding_mask=padding)
        bias = bias + mask
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, **kwargs), (q, k, v))
    torch.testing.assert_close(
        attention(q, k, v, **kwargs), F.scaled_dot_product_attention(q, k, v, attn_mask=bias), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("recompute_qkv", [False, True])
def test_self_attention_in_float64_passes_gradcheck(backend, recompute_qkv):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(24, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(24, generator=gen, dtype=torch.float64, requires_grad=True)
    padding = torch.tensor([[False, False, True], [False, False, False]])

    def ours(x, weight, bias):
        return self_attention(x, weight, bias, 2, is_causal=True, key_padding_mask=padding, recompute_qkv=recompute_qkv)

    q, k, v = rearrange(F.linear(x, weight, bias), "b s (three h d) -> three b h s d", three=3, h=2)
    allowed = ~torch.ones(3, 3, dtype=torch.bool).triu(1) & ~padding[:, None, None, :]
    expected = rearrange(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), "b h s d -> b s (h d)")
    out = ours(x, weight, bias)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(ours, (x, weight, bias), fast_mode=True)


def test_float64_stays_float64_under_autocast_like_sdpa(backend):
    # autocast casts no float64 tensor: SDPA keeps float64 q, k, v, and so does attention
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = attention(q, q, q, is_causal=True), F.scaled_dot_product_attention(q, q, q, is_causal=True)
        x, weight = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(48, 16, dtype=torch.float64)
        self_out = self_attention(x, weight, None, 2, recompute_qkv=True)
    assert out.dtype == expected.dtype == self_out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


# torch's test_scaled_dot_product_attention_{3D,4D}_input_dim_{2D,3D,4D}_causal_attn_mask_dropout_p_{0_0,0_2,0_5}
# (test/test_transformers.py, under the MATH backend: 12 tests): with is_causal=True, SDPA computes the
# causal result without a mask and raises for an explicit one, as the documentation says. Its fused CPU
# and CUDA backends let 4-d calls through; slimformer follows the rule everywhere.
@pytest.mark.parametrize("dropout_p", [0.0, 0.2, 0.5])
@pytest.mark.parametrize(
    "input_dim, attn_mask_dim",
    [(3, 2), (3, 3), (4, 2), (4, 4)],
    ids=["3D_input_dim_2D", "3D_input_dim_3D", "4D_input_dim_2D", "4D_input_dim_4D"],
)
def test_causal_with_an_explicit_attn_mask_raises_like_sdpa(backend, input_dim, attn_mask_dim, dropout_p):
    n, n_prime, seq_q, seq_k, head_dim = 2, 2, 4, 3, 6
    batch = (n,) if input_dim == 3 else (n, n_prime)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*batch, seq, head_dim, generator=gen) for seq in (seq_q, seq_k, seq_k))
    mask = torch.ones((seq_q, seq_k) if attn_mask_dim == 2 else (*batch, seq_q, seq_k), dtype=torch.bool).tril()
    message = "Explicit attn_mask should not be set when is_causal=True"
    with pytest.raises(RuntimeError, match=message), sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(q, k, v, mask, dropout_p, True)
    for attn_mask in (mask, mask.float().log()):
        with pytest.raises(RuntimeError, match=message):
            attention(q, k, v, attn_mask, dropout_p, True)
    if dropout_p == 0.0:
        expected = F.scaled_dot_product_attention(q, k, v, None, 0.0, True)
        torch.testing.assert_close(attention(q, k, v, None, 0.0, True), expected)


def test_self_attention_with_causal_and_an_explicit_attn_mask_raises():
    x, weight = torch.randn(2, 5, 32), torch.randn(96, 32)
    with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when is_causal=True"):
        self_attention(x, weight, None, 4, attn_mask=torch.ones(5, 5, dtype=torch.bool).tril(), is_causal=True)


def test_nested_inputs_are_refused_with_the_argument_named():
    nested = torch.nested.nested_tensor([torch.randn(4, 2, 8), torch.randn(6, 2, 8)], layout=torch.jagged)
    q = nested.transpose(1, 2)
    with pytest.raises(TypeError, match="query must be a dense .strided. tensor, got a nested tensor"):
        attention(q, q, q, is_causal=True)


@pytest.mark.parametrize(
    "q_shape, kv_shape, mask_shape",
    [
        ((3, 7, 16), (3, 9, 16), (3, 7, 9)),
        ((3, 7, 16), (3, 9, 16), (7, 9)),
        ((2, 3, 2, 7, 16), (2, 3, 2, 9, 16), (3, 1, 7, 9)),
        ((2, 3, 2, 7, 16), (2, 3, 2, 9, 16), (2, 1, 1, 7, 9)),
    ],
    ids=["3d", "3d-shared-mask", "5d", "5d-batch-mask"],
)
def test_any_number_of_leading_dims_like_sdpa(backend, q_shape, kv_shape, mask_shape):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(q_shape, generator=gen),
        torch.randn(kv_shape, generator=gen),
        torch.randn(kv_shape, generator=gen),
    )
    grad = torch.randn(q_shape, generator=gen)
    mask = torch.rand(mask_shape, generator=gen) > 0.3
    mask[..., 0] = True
    ours, sdpa = _sdpa_and_ours(q, k, v, grad, attn_mask=mask)
    for name, got, expected in zip(("out", "dq", "dk", "dv"), ours, sdpa):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, msg=name)


def test_takes_sdpa_keyword_names(backend):
    q, k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    kwargs = dict(query=q, key=k, value=v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.3, enable_gqa=False)
    torch.testing.assert_close(attention(**kwargs), F.scaled_dot_product_attention(**kwargs))


@pytest.mark.parametrize("make_bias", [causal_upper_left, causal_lower_right], ids=["upper_left", "lower_right"])
@pytest.mark.parametrize("seq_q, seq_k", [(6, 6), (4, 9), (9, 4)])
def test_causal_bias_is_honoured_like_sdpa(backend, make_bias, seq_q, seq_k):
    gen = torch.Generator().manual_seed(0)
    q, grad = torch.randn(2, 2, seq_q, 16, generator=gen), torch.randn(2, 2, seq_q, 16, generator=gen)
    k, v = torch.randn(2, 2, seq_k, 16, generator=gen), torch.randn(2, 2, seq_k, 16, generator=gen)
    ours, sdpa = _sdpa_and_ours(q, k, v, grad, attn_mask=make_bias(seq_q, seq_k))
    for name, got, expected in zip(("out", "dq", "dk", "dv"), ours, sdpa):
        torch.testing.assert_close(got, expected.nan_to_num(), msg=name)


def test_noncontiguous_inputs_and_broadcast_grad(backend):
    batch, seq, heads, head_dim = 2, 33, 3, 40
    qkv = torch.randn(batch, seq, 3, heads, head_dim)
    q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))
    grad = torch.ones(batch, heads, seq, head_dim)
    got = _forward_backward(lambda q, k, v: attention(q, k, v, is_causal=True).sum(), q, k, v, torch.tensor(1.0))
    bias = _bias(Case(batch, heads, heads, seq, seq, head_dim, causal=True), None, None)
    same_dtype = _forward_backward(lambda q, k, v: _reference(q, k, v, bias), q, k, v, grad)
    exact = _forward_backward(
        lambda q, k, v: _reference(q, k, v, bias.double()), q.double(), k.double(), v.double(), grad.double()
    )
    for name, *tensors in zip(("dq", "dk", "dv"), got[1:], same_dtype[1:], exact[1:]):
        assert_within_reference_error(name, *tensors, ulps=FP32_ULPS)


def test_saves_only_lse_and_seed_beyond_inputs_and_output(backend):
    q, k, v, _, _, key_padding_mask = _inputs(Case(2, 2, 1, 64, 48, 40, masks=("padding",)), torch.float16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    memory = measure_activation_memory(
        attention, q, k, v, dropout_p=0.1, is_causal=True, enable_gqa=True, key_padding_mask=key_padding_mask
    )
    lse_bytes, seed_bytes = 2 * 2 * 64 * 4, 8
    assert memory.saved_bytes == lse_bytes + seed_bytes, memory.saved
    assert memory.alive_bytes == lse_bytes + seed_bytes, memory.alive


def _kept_bytes(fn, seq: int) -> tuple[int, int]:
    """(all bytes kept for backward, bytes of (seq, seq) tensors among them) for fn(q, k, v)."""
    q, k, v = (torch.randn(1, 2, seq, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    memory = measure_activation_memory(fn, q, k, v)
    square = sum(r.nbytes for r in memory.saved + memory.alive if r.shape[-2:] == (seq, seq))
    return max(memory.saved_bytes, memory.alive_bytes), square


def test_kept_bytes_grow_linearly_with_sequence(backend):
    fused = [_kept_bytes(lambda q, k, v: attention(q, k, v, dropout_p=0.1), s) for s in (128, 512)]
    with sdpa_kernel(SDPBackend.MATH):
        math_path = [
            _kept_bytes(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1), s) for s in (128, 512)
        ]
    assert fused[0][1] == fused[1][1] == 0
    assert fused[1][0] / fused[0][0] <= 4.2
    assert 15.5 <= math_path[1][1] / math_path[0][1] <= 16.5


def _small(**overrides):
    shapes = dict(q=(2, 4, 8, 16), k=(2, 4, 9, 16), v=(2, 4, 9, 16))
    tensors = {name: torch.randn(shape) for name, shape in shapes.items()}
    tensors.update(overrides)
    return tensors


BAD_INPUTS = [
    (_small(q=torch.randn(8, 16)), {}, ValueError, "query must be at least 3-d"),
    (_small(q=torch.ones(2, 4, 8, 16, dtype=torch.int32)), {}, TypeError, "query must be float16"),
    (_small(k=torch.randn(2, 4, 9, 16, dtype=torch.float16)), {}, TypeError, "key must have query's dtype"),
    (_small(v=torch.randn(2, 4, 9, 16, device="meta")), {}, ValueError, "value must be on query's device"),
    (_small(k=torch.randn(3, 4, 9, 16), v=torch.randn(3, 4, 9, 16)), {}, ValueError, "leading (batch) dims (2,)"),
    (_small(k=torch.randn(2, 4, 9, 8), v=torch.randn(2, 4, 9, 8)), {}, ValueError, "head_dim 16"),
    (_small(v=torch.randn(2, 4, 10, 16)), {}, ValueError, "value must have key's shape"),
    # a wrong key is blamed on key, not on the value that matches query
    (_small(k=torch.randn(2, 4, 9, 8)), {}, ValueError, "key must have query's head_dim 16, got shape (2, 4, 9, 8)"),
    (_small(k=torch.randn(4, 9, 16)), {}, ValueError, "key must have query's leading (batch) dims (2,)"),
    (_small(k=torch.randn(2, 2, 9, 16), v=torch.randn(2, 2, 9, 16)), {}, ValueError, "enable_gqa=True"),
    (
        _small(k=torch.randn(2, 3, 9, 16), v=torch.randn(2, 3, 9, 16)),
        {"enable_gqa": True},
        ValueError,
        "must divide query's 4 heads",
    ),
    (_small(), {"dropout_p": "0.1"}, TypeError, "dropout_p must be a float in [0, 1), got str '0.1'"),
    (_small(), {"scale": "0.5"}, TypeError, "scale must be a float or None, got str '0.5'"),
    (_small(), {"attn_mask": causal_upper_left(8, 8)}, ValueError, "CausalBias must be for (seq_q, seq_k) = (8, 9)"),
    (_small(), {"attn_mask": causal_upper_left(8, 9), "is_causal": True}, ValueError, "is_causal must be False"),
    (
        _small(q=torch.randn(1, 1, 2, 257), k=torch.randn(1, 1, 2, 257), v=torch.randn(1, 1, 2, 257)),
        {},
        ValueError,
        "head_dim must be in",
    ),
    (_small(), {"dropout_p": 1.0}, ValueError, "dropout_p must be in [0, 1)"),
    (_small(), {"dropout_p": -0.1}, ValueError, "dropout_p must be in [0, 1)"),
    # the Philox counters of one (batch, head) are 32-bit (expanded views: no memory)
    (
        {name: torch.zeros(1, 1, 1, 16).expand(1, 1, 2**18 + 1, 16) for name in "qkv"},
        {"dropout_p": 0.1},
        ValueError,
        "dropout_p > 0 needs ceil(seq_q / 16)",
    ),
    (_small(), {"attn_mask": torch.ones(8, 9, dtype=torch.int64)}, TypeError, "attn_mask must be bool"),
    (_small(), {"attn_mask": torch.ones(2, 4, 8, 8, dtype=torch.bool)}, ValueError, "must broadcast"),
    (_small(), {"attn_mask": torch.ones(1, 2, 4, 8, 9, dtype=torch.bool)}, ValueError, "must broadcast"),
    (_small(), {"attn_mask": torch.zeros(8, 9, requires_grad=True)}, ValueError, "must not require grad"),
    (
        _small(),
        {"attn_mask": torch.ones(8, 9, dtype=torch.bool, device="meta")},
        ValueError,
        "attn_mask must be on q's device",
    ),
    (_small(), {"key_padding_mask": torch.zeros(2, 9)}, TypeError, "key_padding_mask must be bool"),
    (_small(), {"key_padding_mask": torch.zeros(2, 8, dtype=torch.bool)}, ValueError, "(batch, seq_k) = (2, 9)"),
    (_small(), {"deterministic": 0}, TypeError, "deterministic must be a bool, got int 0"),
]


@pytest.mark.parametrize("tensors, kwargs, error, message", BAD_INPUTS)
def test_bad_input_raises(tensors, kwargs, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        attention(tensors["q"], tensors["k"], tensors["v"], **kwargs)


def _self_attention_inputs(**overrides):
    inputs = dict(x=torch.randn(2, 5, 32), qkv_weight=torch.randn(96, 32), qkv_bias=torch.randn(96), num_heads=4)
    inputs.update(overrides)
    return inputs


BAD_SELF_ATTENTION_INPUTS = [
    (_self_attention_inputs(x=torch.randn(5, 32)), ValueError, r"x must be 3-d \(batch, seq, embed\)"),
    (
        _self_attention_inputs(x=torch.ones(2, 5, 32, dtype=torch.int32)),
        TypeError,
        "x must be float16, bfloat16, float32 or float64, got torch.int32",
    ),
    (
        _self_attention_inputs(x=torch.randn(2, 5, 32, dtype=torch.float64)),
        TypeError,
        "qkv_weight must have x's dtype torch.float64, got torch.float32",
    ),
    (_self_attention_inputs(qkv_weight=torch.randn(64, 32)), ValueError, r"qkv_weight must have shape \(96, 32\)"),
    (_self_attention_inputs(qkv_bias=torch.randn(64)), ValueError, r"qkv_bias must have shape \(96,\)"),
    (
        _self_attention_inputs(qkv_weight=torch.randn(96, 32, dtype=torch.float16)),
        TypeError,
        "qkv_weight must have x's dtype",
    ),
    (_self_attention_inputs(num_heads=3), ValueError, "num_heads must divide embed 32, got 3"),
    (_self_attention_inputs(num_heads=2.0), TypeError, "num_heads must be an int, got float"),
    (_self_attention_inputs(qkv_weight=None), TypeError, "qkv_weight must be a torch.Tensor, got NoneType"),
    (_self_attention_inputs(qkv_bias=[0.0] * 96), TypeError, "qkv_bias must be a torch.Tensor, got list"),
    (
        _self_attention_inputs(key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)),
        ValueError,
        "key_padding_mask must have shape",
    ),
]


@pytest.mark.parametrize("inputs, error, message", BAD_SELF_ATTENTION_INPUTS)
def test_self_attention_bad_input_raises(inputs, error, message):
    with pytest.raises(error, match=message):
        self_attention(**inputs)


def test_output_merges_heads_as_a_view(backend):
    q, k, v, _, _, _ = _inputs(Case(2, 3, 3, 17, 20, 40), torch.float32)
    out = attention(q, k, v)
    merged = rearrange(out, "b h s d -> b s (h d)")
    assert merged.data_ptr() == out.data_ptr() and merged.is_contiguous()


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize("dtype, ulps", GPU_DTYPES)
def test_matches_reference_on_gpu(dtype, ulps, case):
    _check_case(case, dtype, ulps, "cuda")


# Each way dK/dV tiles draw their dropout bits on sm_90: lane pairs sharing out Philox calls
# (dropout alone, 32+ query rows), both lanes computing them (GQA, which takes no lane
# pairs; masked d128 tiles of 16 query rows), and dQ by atomics.
DROPOUT_GPU_CASES = [
    (Case(2, 8, 2, 1024, 1537, 64, causal=True, masks=("padding",)), True),
    (Case(2, 4, 4, 512, 512, 64), True),
    (Case(2, 4, 4, 300, 257, 128, causal=True, masks=("padding",)), True),
    (Case(1, 4, 2, 300, 257, 128, causal=True), True),
    (Case(2, 4, 4, 300, 257, 64, causal=True), False),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case, deterministic",
    DROPOUT_GPU_CASES,
    ids=[f"{case}-{'deterministic' if d else 'atomic-dq'}" for case, d in DROPOUT_GPU_CASES],
)
@pytest.mark.parametrize("dtype, ulps", GPU_DTYPES)
def test_dropout_on_gpu(dtype, ulps, case, deterministic):
    _check_dropout(case, dtype, ulps, "cuda", p=0.1, deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 40, 64, 80, 96, 112, 128, 256])
@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_every_head_dim_on_gpu(dtype, ulps, head_dim):
    _check_case(Case(2, 4, 2, 300, 257, head_dim, causal=True, masks=("padding", "additive")), dtype, ulps, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["q_nan", "k_inf", "v_nan", "scale_nan", "mask_nan", "mask_inf"])
def test_nan_and_inf_propagate_like_sdpa_on_gpu(where):
    # compiled max reductions skip NaN where numpy's propagate it: the epilogue must not care
    q, k, v, grad, kwargs = _poisoned(where)
    kwargs = {name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
    ours, sdpa = _sdpa_and_ours(q.cuda(), k.cuda(), v.cuda(), grad.cuda(), **kwargs)
    for name, got, expected in zip(("out", "dq", "dk", "dv"), ours, sdpa):
        assert torch.equal(got.isnan(), expected.isnan()), name


def _window_inputs(seq=200, head_dim=16):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, seq, head_dim, generator=gen) for _ in range(4)]


@pytest.mark.parametrize("window", [2**31 - 1, 2**40, sys.maxsize, 2**63, np.int64(2**62)], ids=str)
def test_a_window_past_the_sequence_limits_nothing(backend, window):
    # Windows >= seq are clamped to seq before the kernels add it to int32 block offsets
    # (unclamped, 2**31 - 1 wrapped and left every row with no key: zeros).
    q, k, v, grad = _window_inputs()
    got = _forward_backward(lambda q, k, v: attention(q, k, v, window=window), q, k, v, grad)
    whole = _forward_backward(lambda q, k, v: attention(q, k, v, window=199), q, k, v, grad)
    assert got[0].abs().amax() > 0.1
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, whole):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "window, error, message",
    [
        (-1, ValueError, "window must be >= 0 .*got -1"),
        (-(2**63), ValueError, "window must be >= 0"),
        (2.0, TypeError, "window must be an int, got float 2.0"),
        (True, TypeError, "window must be an int, got bool True"),
        ("8", TypeError, "window must be an int, got str '8'"),
        (torch.tensor(8), TypeError, "window must be an int, got Tensor"),
    ],
    ids=str,
)
def test_bad_window_raises_naming_it(window, error, message):
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(error, match=message):
        attention(q, q, q, window=window)


def _poison_key(x: torch.Tensor, key: int) -> torch.Tensor:
    x = x.clone()
    x[:, :, key, 3] = math.nan
    return x


@pytest.mark.parametrize("poisoned", ["k", "v", "kv"])
def test_a_padding_key_is_never_read(backend, poisoned):
    # A NaN in a padding key's k or v reaches no output and no gradient, on both paths:
    # the call equals the one with that key's values finite, and its dk and dv are zero.
    q, k, v, grad = _window_inputs()
    padding = torch.zeros(1, 200, dtype=torch.bool)
    padding[0, 150:] = True
    q[0, 1, 7, 2] = math.nan  # a NaN row, whose p is NaN for every key it reads
    bad_k = _poison_key(k, 170) if "k" in poisoned else k
    bad_v = _poison_key(v, 170) if "v" in poisoned else v
    for kwargs in (dict(), dict(is_causal=True), dict(window=40)):

        def fn(q, k, v):
            return attention(q, k, v, key_padding_mask=padding, **kwargs)

        got = _forward_backward(fn, q, bad_k, bad_v, grad)
        clean = _forward_backward(fn, q, k, v, grad)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, clean):
            assert torch.equal(a.isnan(), b.isnan()), f"{name} {kwargs}: NaNs where the clean call has none"
            torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0, msg=f"{name} {kwargs}")
        assert not got[0][0, 0].isnan().any() and got[0][0, 1, 7].isnan().all()
        assert (got[2][:, :, 150:] == 0).all() and (got[3][:, :, 150:] == 0).all()


@pytest.mark.parametrize(
    "key, kwargs",
    [(100, dict(window=5)), (190, dict(window=5)), (3, dict(window=0)), (150, dict(is_causal=True))],
    ids=str,
)
def test_a_nan_key_reaches_the_rows_that_may_attend_it(backend, key, kwargs):
    # Its score is replaced by -inf for every row that may not attend it, on both paths
    # (SDPA's NaN + -inf mask would make every row NaN).
    q, k, v, grad = _window_inputs()
    got = _forward_backward(lambda q, k, v: attention(q, k, v, **kwargs), q, _poison_key(k, key), v, grad)
    rows = torch.arange(200)
    if "window" in kwargs:
        reads = (rows - key).abs() <= kwargs["window"]
    else:
        reads = rows >= key
    assert torch.equal(got[0].isnan().any(-1), reads.expand(1, 2, 200))
    assert got[1][:, :, reads].isnan().all(-1).all()  # dq of the rows that read it
