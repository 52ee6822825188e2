"""slimformer.varlen_attention vs SDPA run on each sequence alone (float64 exact, and in the
tensor's dtype for PyTorch's own error), through the interpreted kernels and the reference."""

import itertools
import math
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from slimformer.kernels import dispatch
from slimformer.kernels.attention import attention, configs, ops, varlen_attention
from slimformer.kernels.philox import dropout_keep_mma_block, dropout_threshold
from tests.helpers import assert_within_reference_error

DTYPES = [
    pytest.param(torch.float32, 8.0, id="fp32"),
    pytest.param(torch.float16, 1.0, id="fp16"),
    pytest.param(torch.bfloat16, 1.0, id="bf16"),
]
# (lengths, heads, kv_heads, head_dim, causal)
CASES = [
    pytest.param((1, 17, 97), 2, 2, 64, False, id="len1-17-97-d64"),
    pytest.param((17, 1, 5), 2, 1, 40, True, id="len17-1-5-d40-gqa-causal"),
    pytest.param((0, 33, 0, 2), 1, 1, 16, True, id="empty-len33-causal"),
]


def _cu_seqlens(lengths):
    return F.pad(torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))


def _inputs(lengths, heads, kv_heads, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=generator).to(dtype)
    do = torch.randn(total, heads, head_dim, generator=generator).to(dtype)
    return q, k, v, do


def _per_sequence_sdpa(q, k, v, do, cu, causal):
    """SDPA on each sequence alone, in q's dtype: (out, dq, dk, dv) packed."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    bounds = cu.tolist()
    outs = []
    for start, stop in zip(bounds, bounds[1:]):
        heads_first = [t[start:stop].transpose(0, 1)[None] for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*heads_first, is_causal=causal, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    out = torch.cat(outs)
    grads = torch.autograd.grad(out, (q, k, v), do)
    return (out.detach(), *grads)


def _varlen(q, k, v, do, cu, max_len, causal, dropout_p=0.0, deterministic=True):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = varlen_attention(
        q, k, v, cu, cu, max_len, max_len, dropout_p, causal, return_lse=True, deterministic=deterministic
    )
    grads = torch.autograd.grad(out, (q, k, v), do)
    return (out.detach(), *grads), lse


@pytest.mark.parametrize("dtype, ulps", DTYPES)
@pytest.mark.parametrize("lengths, heads, kv_heads, head_dim, causal", CASES)
def test_matches_sdpa_per_sequence(backend, lengths, heads, kv_heads, head_dim, causal, dtype, ulps):
    q, k, v, do = _inputs(lengths, heads, kv_heads, head_dim, dtype)
    cu = _cu_seqlens(lengths)
    actual, lse = _varlen(q, k, v, do, cu, max(lengths), causal)
    same_dtype = _per_sequence_sdpa(q, k, v, do, cu, causal)
    exact = _per_sequence_sdpa(q.double(), k.double(), v.double(), do.double(), cu, causal)
    for name, a, t, e in zip(("out", "dq", "dk", "dv"), actual, same_dtype, exact):
        assert a.dtype == dtype
        assert_within_reference_error(name, a, t, e, ulps=ulps, scale=4.0)
    assert lse.shape == (heads, sum(lengths)) and lse.dtype == torch.float32


@pytest.mark.parametrize(
    "arch, shared_kb, lengths, heads, kv_heads, head_dim",
    [(80, 163, (1, 17, 150), 2, 1, 64), (86, 99, (1, 17, 70), 1, 1, 256)],
    ids=["sm80", "99kb-d256"],
)
def test_other_devices_block_configs_match_sdpa(
    backend, monkeypatch, arch, shared_kb, lengths, heads, kv_heads, head_dim
):
    """sm_80's block configs, and the 99 KB table's own d256 configs (compute capability 8.6 /
    8.9), forced (CPU launches take sm_90's), give the same results."""
    monkeypatch.setattr(dispatch, "device_target", lambda _tensor: dispatch.DeviceTarget(arch, shared_kb * 1024))
    q, k, v, do = _inputs(lengths, heads, kv_heads, head_dim, torch.float16)
    cu = _cu_seqlens(lengths)
    actual, _ = _varlen(q, k, v, do, cu, max(lengths), True)
    same_dtype = _per_sequence_sdpa(q, k, v, do, cu, True)
    exact = _per_sequence_sdpa(q.double(), k.double(), v.double(), do.double(), cu, True)
    for name, a, t, e in zip(("out", "dq", "dk", "dv"), actual, same_dtype, exact):
        assert_within_reference_error(name, a, t, e, ulps=1.0, scale=4.0)


DEVICES = {"sm90": (90, 227 * 1024), "sm80": (80, 163 * 1024), "sm86": (86, 99 * 1024)}
# configs of the varlen launches that differ from the dense table's, which spill there
OWN_CONFIGS = {
    "sm90": {
        ("fwd", 128, "plain"): (128, 128, 8, 2),
        ("fwd", 128, "dropout"): (128, 64, 8, 2),
        ("dkdv", 128, "dropout"): (16, 128, 8, 2),
        ("dkdv_dq", 128, "dropout"): (16, 128, 8, 2),
    },
    "sm80": {("dkdv", 256, "plain"): (64, 32, 8, 2), ("dq", 128, "dropout"): (64, 32, 4, 2)},
    "sm86": {("dq", 128, "dropout"): (64, 32, 4, 2)},
}


def _force_device(monkeypatch, device):
    target = dispatch.DeviceTarget(*DEVICES[device])
    monkeypatch.setattr(dispatch, "device_target", lambda _tensor: target)
    return target


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_configs_are_the_dense_ones_but_where_those_spill(device):
    arch, shared_bytes = DEVICES[device]
    for kernel, head_dim, kind, dtype in itertools.product(
        ("fwd", "dkdv", "dkdv_dq", "dq"), (64, 96, 256), ("plain", "dropout"), (torch.bfloat16, torch.float32)
    ):
        config = configs.block_config(head_dim, dtype, kernel, kind, arch, shared_bytes, varlen=True)
        dense = configs.block_config(head_dim, dtype, kernel, kind, arch, shared_bytes)
        own = OWN_CONFIGS[device].get((kernel, dense["BLOCK_D"], kind)) if dtype != torch.float32 else None
        if own is not None:
            dense.update(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), own))
        assert config == dense, (kernel, head_dim, kind, dtype)


@pytest.mark.parametrize("device", ["sm80", "sm86"])
def test_mma_sync_own_configs_match_reference(monkeypatch, device):
    """Interpreted, the varlen launches' own configs on mma.sync devices (dQ at d128 with
    dropout; sm_80's dK/dV at d256) give the reference's results with its dropout mask."""
    _force_device(monkeypatch, device)
    lengths = (1, 17, 70)
    for head_dim, p in ((96, 0.25), (256, 0.0)):
        q, k, v, do = _inputs(lengths, 2, 2, head_dim, torch.float16)
        cu = _cu_seqlens(lengths)
        results = []
        for interpret, dtype in (("1", torch.float16), ("0", torch.float16), ("0", torch.float64)):
            monkeypatch.setenv("TRITON_INTERPRET", interpret)
            torch.manual_seed(3)
            results.append(_varlen(*(t.to(dtype) for t in (q, k, v, do)), cu, 70, True, dropout_p=p)[0])
        for name, *tensors in zip(("out", "dq", "dk", "dv"), *results):
            assert_within_reference_error(f"d{head_dim} {name}", *tensors, ulps=1.0, scale=4.0)


def test_lse_is_log_sum_exp_per_sequence(backend):
    lengths = (3, 17)
    q, k, v, do = _inputs(lengths, 2, 2, 16, torch.float32)
    cu = _cu_seqlens(lengths)
    _, lse = _varlen(q, k, v, do, cu, 17, False)
    bounds = cu.tolist()
    for start, stop in zip(bounds, bounds[1:]):
        s = torch.einsum("ihd,jhd->hij", q[start:stop].double(), k[start:stop].double()) / 4.0
        torch.testing.assert_close(lse[:, start:stop].double(), s.logsumexp(-1), atol=1e-5, rtol=1e-5)


def test_query_without_keys_is_zero_with_zero_gradient(backend):
    q, k, v, do = _inputs((3,), 2, 2, 16, torch.float32)
    cu_q, cu_k = _cu_seqlens((3, 0)), _cu_seqlens((0, 3))
    q_, k_, v_ = (t.requires_grad_() for t in (q, k, v))
    out, lse = varlen_attention(q_, k_, v_, cu_q, cu_k, 3, 3, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()
    grads = torch.autograd.grad(out, (q_, k_, v_), do)
    for grad in grads:
        assert torch.equal(grad, torch.zeros_like(grad))


def _dropout_case():
    """q = k = 0 (uniform attention) and v_j = e_j, so o_i[j] = r z_ij / len: o shows the mask."""
    lengths, heads, head_dim = (1, 17, 40), 2, 64
    total = sum(lengths)
    q = torch.zeros(total, heads, head_dim)
    k = torch.zeros(total, heads, head_dim)
    v = torch.zeros(total, heads, head_dim)
    for start, stop in zip(_cu_seqlens(lengths).tolist(), _cu_seqlens(lengths).tolist()[1:]):
        v[start:stop, :, : stop - start] = torch.eye(stop - start)[:, None, :]
    return lengths, q, k, v


def test_dropout_masks_are_the_documented_philox_bits(backend):
    lengths, q, k, v = _dropout_case()
    cu, max_len, p = _cu_seqlens(lengths), 48, 0.3
    torch.manual_seed(7)
    out = varlen_attention(q, k, v, cu, cu, max_len, max_len, p)
    torch.manual_seed(7)
    seed = torch.randint(0, 2**62, (), dtype=torch.int64)  # what the op draws
    heads = q.shape[1]
    bounds = cu.tolist()
    for b, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        # sequence b, head h: the (length, length) matrix of stream b · heads + h
        length = stop - start
        keep = dropout_keep_mma_block(seed, heads, 0, length, length, length, p, first_stream=b * heads)
        expected = keep.transpose(0, 1) * (dropout_threshold(p)[1] / length)
        torch.testing.assert_close(out[start:stop, :, :length], expected, atol=1e-6, rtol=1e-6)
    dropped = (out[1:18, :, :17] == 0).float().mean().item()  # sequence of 17: 578 decisions
    assert 0.2 < dropped < 0.4, dropped


def test_dropout_kernel_equals_reference(monkeypatch):
    lengths = (1, 17, 33)
    q, k, v, do = _inputs(lengths, 2, 2, 16, torch.float32)
    cu = _cu_seqlens(lengths)
    results = {}
    for interpret in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        torch.manual_seed(3)
        results[interpret] = _varlen(q, k, v, do, cu, 40, True, dropout_p=0.25)[0]
    for name, kernel, reference in zip(("out", "dq", "dk", "dv"), results["1"], results["0"]):
        torch.testing.assert_close(kernel, reference, atol=2e-6, rtol=2e-6, msg=name)
    # the mask really dropped something: the output differs from no dropout
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not torch.allclose(results["0"][0], _varlen(q, k, v, do, cu, 40, True)[0][0])


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_is_dense_attentions_per_sequence(backend, causal):
    """One dropout scheme: sequence b gets the mask that ``attention`` gives batch entry b
    of a batch of sequences of its length (the same seed), so the outputs are equal."""
    lengths, heads = (5, 0, 33, 33), 2
    q, k, v, _ = _inputs(lengths, heads, 1, 16, torch.float32)
    cu = _cu_seqlens(lengths)
    torch.manual_seed(11)
    out = varlen_attention(q, k, v, cu, cu, 33, 33, 0.3, causal)
    torch.manual_seed(11)
    batched = [t[38:].view(1, 33, -1, 16).expand(4, -1, -1, -1).transpose(1, 2) for t in (q, k, v)]
    dense = attention(*batched, dropout_p=0.3, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(out[38:], dense[3].transpose(0, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_atomic_dq_matches_deterministic(backend, dropout_p):
    """deterministic=False adds dQ with atomics in the dK/dV kernel: the same gradients."""
    lengths = (1, 17, 40)
    q, k, v, do = _inputs(lengths, 4, 2, 24, torch.float32)
    cu = _cu_seqlens(lengths)
    results = []
    for deterministic in (True, False):
        torch.manual_seed(5)
        results.append(_varlen(q, k, v, do, cu, 40, True, dropout_p, deterministic)[0])
    for name, atomic, two_pass in zip(("out", "dq", "dk", "dv"), results[1], results[0]):
        torch.testing.assert_close(atomic, two_pass, atol=1e-5, rtol=1e-5, msg=name)


def test_gradcheck_float64():
    lengths = (2, 3)
    q, k, v, _ = _inputs(lengths, 2, 1, 4, torch.float64)
    cu = _cu_seqlens(lengths)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: varlen_attention(q, k, v, cu, cu, 3, 3, is_causal=True), inputs)


def _good():
    q, k, v, _ = _inputs((2, 3), 2, 2, 16, torch.float32)
    return dict(
        query=q,
        key=k,
        value=v,
        cu_seqlens_q=_cu_seqlens((2, 3)),
        cu_seqlens_k=_cu_seqlens((2, 3)),
        max_seqlen_q=3,
        max_seqlen_k=3,
    )


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(cu_seqlens_q=torch.tensor([0, 2, 5])), TypeError, "cu_seqlens_q must be int32, got torch.int64"),
        (dict(cu_seqlens_k=torch.tensor([1, 2, 5], dtype=torch.int32)), ValueError, "cu_seqlens_k must start at 0"),
        (
            dict(cu_seqlens_q=torch.tensor([0, 4, 2, 5], dtype=torch.int32), cu_seqlens_k=_cu_seqlens((2, 0, 3))),
            ValueError,
            "cu_seqlens_q must be non-decreasing, got 4 then 2",
        ),
        (
            dict(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32)),
            ValueError,
            "cu_seqlens_q\\[-1\\] must equal query's number of rows 5, got 4",
        ),
        (dict(cu_seqlens_k=_cu_seqlens((5,))), ValueError, "cu_seqlens_k must have cu_seqlens_q's 3 entries"),
        (dict(cu_seqlens_q=_cu_seqlens((2, 3))[None]), ValueError, "cu_seqlens_q must be 1-d"),
        (dict(cu_seqlens_q=[0, 2, 5]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
        (dict(max_seqlen_k=2), ValueError, "max_seqlen for cu_seqlens_k must be at least its longest sequence 3"),
        (dict(max_seqlen_q=3.0), TypeError, "max_seqlen_q must be an int"),
        (dict(query=torch.randn(5, 2, 16)[None]), ValueError, "query must be 3-d"),
        (dict(key=torch.randn(5, 3, 16), value=torch.randn(5, 3, 16)), ValueError, "must divide query's 2 heads"),
        (dict(value=torch.randn(5, 2, 8)), ValueError, "value must have key's shape"),
        (dict(key=torch.randn(5, 2, 16).half()), TypeError, "key must have query's dtype"),
        (dict(query=torch.randn(5, 2, 16).long()), TypeError, "query must be float16, bfloat16, float32"),
    ],
)
def test_bad_input(change, error, message):
    with pytest.raises(error, match=message):
        varlen_attention(**{**_good(), **change})


def test_cu_seqlens_are_checked_once_until_written(monkeypatch):
    """Every layer of a packed batch passes the same cu_seqlens: checked on its first call
    (each check is several launches on a GPU), again after an in-place write or for other rows."""
    checks = []
    monkeypatch.setattr(ops, "_check_cu_seqlens", lambda name, *args: checks.append(name))
    good = _good()
    cu = good["cu_seqlens_q"].clone()
    good.update(cu_seqlens_q=cu, cu_seqlens_k=cu)  # self-attention's: one tensor for both
    for _ in range(3):
        varlen_attention(**good)
    assert checks == ["cu_seqlens_q"]
    cu[0] = 0  # an in-place write moves its version
    varlen_attention(**good)
    assert checks == ["cu_seqlens_q"] * 2
    ops.check_cu_seqlens("cu_seqlens_q", cu, 6, 3, "query")
    assert checks == ["cu_seqlens_q"] * 3
    with torch.inference_mode():  # an inference tensor keeps no version: checked every call
        frozen = cu.clone()
        for _ in range(2):
            varlen_attention(**{**good, "cu_seqlens_q": frozen, "cu_seqlens_k": frozen})
    assert checks == ["cu_seqlens_q"] * 3 + ["cu_seqlens_q", "cu_seqlens_k"] * 2


def test_bad_dropout():
    with pytest.raises(ValueError, match="dropout_p must be in"):
        varlen_attention(**_good(), dropout_p=1.0)


def test_memory_kept_is_q_k_v_out_lse():
    """Saved for backward: q, k, v, out, lse, the seed and both cu_seqlens, nothing per score."""
    q, k, v, _ = _inputs((3, 9), 2, 2, 16, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = _cu_seqlens((3, 9))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        saved = []
        out = varlen_attention(q, k, v, cu, cu, 9, 9, 0.1)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == sorted([(12, 2, 16)] * 4 + [(2, 12), (), (3,), (3,)]), shapes
    assert out.is_contiguous()


def _windowed(q, k, v, do, cu, max_len, window):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = varlen_attention(q, k, v, cu, cu, max_len, max_len, window=window)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))


@pytest.mark.parametrize("window", [2**31 - 1, 2**40, sys.maxsize, 2**63, np.int64(2**62)], ids=str)
def test_a_window_past_the_longest_sequence_limits_nothing(backend, window):
    lengths = [200, 37]
    q, k, v, do = _inputs(lengths, 2, 1, 16, torch.float32)
    cu = _cu_seqlens(lengths)
    got = _windowed(q, k, v, do, cu, 200, window)
    whole = _windowed(q, k, v, do, cu, 200, 199)
    assert got[0].abs().amax() > 0.1
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, whole):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("window", [None, 3])
def test_another_sequences_keys_are_never_read(backend, window):
    # NaN in every key and value of sequence 0 reaches nothing of sequence 1, which has
    # a NaN row of its own
    lengths = [70, 90]
    q, k, v, do = _inputs(lengths, 2, 2, 16, torch.float32)
    cu = _cu_seqlens(lengths)
    q[100, 1, 4] = math.nan
    bad_k, bad_v = k.clone(), v.clone()
    bad_k[:70], bad_v[:70] = math.nan, math.nan
    got = _windowed(q, bad_k, bad_v, do, cu, 90, window)
    clean = _windowed(q, k, v, do, cu, 90, window)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, clean):
        torch.testing.assert_close(a[70:], b[70:], equal_nan=True, rtol=0, atol=0, msg=name)
    assert got[0][:70].isnan().all()
    assert got[0][70:, 0].isfinite().all() and got[0][100, 1].isnan().all()


@pytest.mark.parametrize(
    "window, error, message",
    [
        (-1, ValueError, "window must be >= 0 .*got -1"),
        (1.5, TypeError, "window must be an int, got float 1.5"),
        (False, TypeError, "window must be an int, got bool False"),
    ],
    ids=str,
)
def test_bad_window_raises_naming_it(window, error, message):
    q, k, v, _ = _inputs([4], 1, 1, 8, torch.float32)
    cu = _cu_seqlens([4])
    with pytest.raises(error, match=message):
        varlen_attention(q, k, v, cu, cu, 4, 4, window=window)


def test_max_seqlen_takes_a_numpy_integer(backend):
    q, k, v, _ = _inputs([5, 3], 1, 1, 8, torch.float32)
    cu = _cu_seqlens([5, 3])
    expected = varlen_attention(q, k, v, cu, cu, 5, 5)
    assert torch.equal(varlen_attention(q, k, v, cu, cu, np.int64(5), np.int32(5), window=np.int16(9)), expected)
