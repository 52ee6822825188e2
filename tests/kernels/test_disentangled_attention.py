"""``disentangled_attention``: DeBERTa-v2/v3's disentangled self-attention, fused.

The oracle is transformers' own ``DisentangledSelfAttention`` in float64 (the exact result
from the same rounded inputs), and the same module in the input dtype is PyTorch's own
error: slimformer, fed the module's projections, must stay within twice that. Every CPU
test runs through the ``backend`` fixture (the interpreted Triton kernels and the PyTorch
reference path); long sequences run on the reference path only. Inputs without a
transformers module (cross lengths, dropout, edge cases) are held to an explicit dense
oracle that buckets the relative positions with transformers' ``build_relative_position``.
"""

import contextlib
import functools
import itertools
import math
import os
import re
from dataclasses import dataclass

import pytest
import torch
from einops import rearrange
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import DebertaV2Config
from transformers.models.deberta_v2.modeling_deberta_v2 import (
    DebertaV2Encoder,
    DisentangledSelfAttention,
    build_relative_position,
    scaled_size_sqrt,
)

from slimformer.kernels.attention import attention, disentangled as disentangled_module
from slimformer.kernels.attention.disentangled import (
    disentangled_attention,
    relative_position_index,
    varlen_disentangled_attention,
)
from slimformer.kernels.philox import dropout_threshold, new_dropout_seed
from slimformer.memory import measure_activation_memory
from tests.helpers import assert_within_reference_error
from tests.kernels.test_attention import DTYPES, FP32_ULPS, _keep

# The kernels' backward takes delta_i = Σ_d dO_id O_id from the output as stored, in 16
# bits (FlashAttention's delta; the PyTorch reference and transformers sum P ∘ dP in fp32):
# an error of half an output ULP times |dO_i|, shared by every score of row i, that a row
# of few keys does not average out. It is most of the 16-bit kernels' gradient error at seq 2.
KERNEL_16BIT_GRAD_ULPS = 8.0


def _grad_ulps(backend: str, dtype: torch.dtype, ulps: float) -> float:
    return KERNEL_16BIT_GRAD_ULPS if backend == "triton" and dtype != torch.float32 else ulps


# ----------------------------------------------------------------------------- transformers' module


@dataclass(frozen=True)
class Deberta:
    """A DeBERTa-v2 attention layer: heads · head_dim = hidden size; span = position_buckets
    when positive, else max_relative_positions. Batch entry 0 pads its last third of tokens
    (one of two), entry 2 all of them. ``query_padding``: slimformer takes the padded
    queries as ``query_padding_mask`` (transformers' uniform rows, compared too); else
    only keys are masked and padded queries are left out."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    pos_att_type: tuple[str, ...] = ("c2p", "p2c")
    share_att_key: bool = False
    position_buckets: int = 8
    max_relative_positions: int = 32
    query_padding: bool = True

    def __str__(self) -> str:
        positions = (
            f"buckets{self.position_buckets}max{self.max_relative_positions}"
            if self.position_buckets > 0
            else f"span{self.max_relative_positions}"
        )
        flags = (
            "+".join(self.pos_att_type),
            positions,
            "shared" * self.share_att_key,
            "uniform-padded-queries" if self.query_padding else "key-padding-only",
        )
        return "-".join([f"b{self.batch}h{self.heads}s{self.seq}d{self.head_dim}", *filter(None, flags)])


# seq 1 and 2, and odd lengths that are no multiple of the 16/32/64 tiles
HF_CASES = [
    Deberta(1, 1, 1, 16),
    Deberta(2, 1, 2, 16, ("c2p",)),
    Deberta(2, 2, 17, 16, ("p2c",), share_att_key=True, query_padding=False),
    Deberta(2, 3, 33, 24, position_buckets=-1, max_relative_positions=12),
    Deberta(1, 2, 65, 32, share_att_key=True, position_buckets=16, max_relative_positions=64),
    Deberta(2, 2, 70, 16, ("c2p",), position_buckets=-1, max_relative_positions=40, query_padding=False),
    Deberta(3, 2, 70, 8, ("p2c",), position_buckets=4, max_relative_positions=16),
]
# the PyTorch reference only (the interpreter would take minutes): distances far past the
# buckets' max_relative_positions, clamped to the span's ends
LONG_HF_CASES = [
    Deberta(1, 1, 513, 8, position_buckets=32, max_relative_positions=128, query_padding=False),
    Deberta(2, 1, 1024, 8, share_att_key=True, position_buckets=-1, max_relative_positions=256),
]


def _module(case: Deberta) -> DisentangledSelfAttention:
    """The layer in float32, in eval mode, with weights large enough for peaked softmaxes."""
    hidden = case.heads * case.head_dim
    config = DebertaV2Config(
        hidden_size=hidden,
        num_attention_heads=case.heads,
        intermediate_size=4 * hidden,
        relative_attention=True,
        pos_att_type=list(case.pos_att_type),
        share_att_key=case.share_att_key,
        position_buckets=case.position_buckets,
        max_relative_positions=case.max_relative_positions,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    module = DisentangledSelfAttention(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            std = hidden**-0.5 if name.endswith("weight") else 0.1
            parameter.copy_(torch.randn(parameter.shape, generator=gen) * std)
    return module


def _layer_inputs(case: Deberta, dtype: torch.dtype):
    """hidden states, the (batch, seq) attention mask (1 = token), rel_embeddings and the
    output's upstream gradient (zero at padded queries that are left out)."""
    gen = torch.Generator().manual_seed(0)
    hidden = case.heads * case.head_dim
    span = case.position_buckets if case.position_buckets > 0 else case.max_relative_positions
    states = (1.5 * torch.randn(case.batch, case.seq, hidden, generator=gen)).to(dtype)
    rel_embeddings = torch.randn(2 * span, hidden, generator=gen).to(dtype)
    mask = torch.ones(case.batch, case.seq, dtype=torch.long)
    if case.seq > 1:
        mask[0, case.seq - max(1, case.seq // 3) :] = 0
    mask[2:3] = 0
    grad = torch.randn(case.batch, case.seq, hidden, generator=gen).to(dtype)
    if not case.query_padding:
        grad = grad * mask[..., None]
    return states, mask, rel_embeddings, grad


def _transformers(module: DisentangledSelfAttention, states, mask, rel_embeddings) -> torch.Tensor:
    """The layer's context (batch, seq, hidden), fed as ``DebertaV2Encoder`` feeds it: the
    (batch, 1, seq, seq) product mask of ``get_attention_mask`` (which reads nothing of the
    encoder) and ``build_relative_position``'s buckets."""
    attention_mask = DebertaV2Encoder.get_attention_mask(None, mask)
    relative_pos = build_relative_position(
        states, states, bucket_size=module.position_buckets, max_position=module.max_relative_positions
    )
    return module(states, attention_mask, relative_pos=relative_pos, rel_embeddings=rel_embeddings)[0]


def _slimformer(module: DisentangledSelfAttention, states, mask, rel_embeddings, query_padding=True) -> torch.Tensor:
    """The same context by ``disentangled_attention`` on the module's projections: q, k, v as
    head views (batch, heads, seq, head_dim) and the position projections of the first
    2 · span rows of rel_embeddings (transformers' own slice) per head."""
    heads = module.num_attention_heads
    q, k, v = (
        rearrange(projection(states), "b s (h d) -> b h s d", h=heads)
        for projection in (module.query_proj, module.key_proj, module.value_proj)
    )
    rel_embeddings = rel_embeddings[: 2 * module.pos_ebd_size]

    def positions(kind, shared, own):
        if kind not in module.pos_att_type:
            return None
        projection = shared if module.share_att_key else getattr(module, own)
        return rearrange(projection(rel_embeddings), "p (h d) -> h p d", h=heads)

    pos_key = positions("c2p", module.key_proj, "pos_key_proj")
    pos_query = positions("p2c", module.query_proj, "pos_query_proj")
    # transformers divides by sqrt(head_dim · factor) computed in float32
    factor = 1 + (pos_key is not None) + (pos_query is not None)
    out = disentangled_attention(
        q,
        k,
        v,
        pos_key,
        pos_query,
        position_buckets=module.position_buckets,
        max_relative_positions=module.max_relative_positions,
        key_padding_mask=mask == 0,
        query_padding_mask=mask == 0 if query_padding else None,
        scale=1.0 / scaled_size_sqrt(q, factor).item(),
    )
    return rearrange(out, "b h s d -> b s (h d)")


def _layer_grads(run, module, states, mask, rel_embeddings, grad, linear_calls=None) -> dict[str, torch.Tensor]:
    """run's output and the gradients of the hidden states, rel_embeddings and every
    parameter, by name; with ``linear_calls``, (layer, the gradient its input feeds, input,
    output gradient) of each call of the module's linear layers is appended to it."""
    module.zero_grad(set_to_none=True)
    states, rel_embeddings = (x.detach().clone().requires_grad_() for x in (states, rel_embeddings))
    handles = []
    if linear_calls is not None:

        def record(linear, inputs, output):
            x = inputs[0]
            assert x.data_ptr() in (states.data_ptr(), rel_embeddings.data_ptr())
            reads = "d hidden" if x.data_ptr() == states.data_ptr() else "d rel_embeddings"
            output.register_hook(lambda g: linear_calls.append((linear, reads, x.detach(), g.detach())))

        handles = [m.register_forward_hook(record) for m in module.modules() if isinstance(m, nn.Linear)]
    try:
        out = run(module, states, mask, rel_embeddings)
    finally:
        for handle in handles:
            handle.remove()
    out.backward(grad)
    grads = {f"d {name}": parameter.grad for name, parameter in module.named_parameters()}
    return {"out": out.detach(), "d hidden": states.grad, "d rel_embeddings": rel_embeddings.grad, **grads}


def _summed_magnitudes(module, linear_calls) -> dict[str, float]:
    """Each gradient the module's linear layers sum up, with every term's magnitude: Σ |g|
    for a bias, |g|ᵀ|x| for a weight, Σ |g| |W| for the hidden states and rel_embeddings
    (over every layer that reads them), at its largest element; g the layer's output
    gradient. The key projection's bias gets an exact gradient of 0 when p2c is absent
    (softmax is blind to a shift of a row): its error is relative to these terms, not to 0."""
    names = {linear: name for name, linear in module.named_modules()}
    sums: dict[str, torch.Tensor] = {}

    def add(name, value):
        sums[name] = value if name not in sums else sums[name] + value

    for linear, reads, x, g in linear_calls:
        x, g = x.abs().flatten(0, -2), g.abs().flatten(0, -2)
        add(f"d {names[linear]}.bias", g.sum(0))
        add(f"d {names[linear]}.weight", g.T @ x)
        add(reads, g @ linear.weight.detach().abs())
    return {name: value.max().item() for name, value in sums.items()}


def _check_against_transformers(case: Deberta, dtype: torch.dtype, ulps: float, grad_ulps: float) -> None:
    # Without query_padding_mask, transformers' padded queries (every score finfo.min: a
    # uniform average of every value) differ from disentangled_attention's (which attend
    # to the unpadded keys): their outputs are left out and get no gradient.
    module = _module(case).to(dtype)
    exact_module = _module(case).to(dtype).double()
    states, mask, rel_embeddings, grad = _layer_inputs(case, dtype)
    ours = functools.partial(_slimformer, query_padding=case.query_padding)
    got = _layer_grads(ours, module, states, mask, rel_embeddings, grad)
    same_dtype = _layer_grads(_transformers, module, states, mask, rel_embeddings, grad)
    calls = []
    exact = _layer_grads(
        _transformers, exact_module, states.double(), mask, rel_embeddings.double(), grad.double(), calls
    )
    scales = _summed_magnitudes(exact_module, calls)
    if not case.query_padding:
        for result in (got, same_dtype, exact):
            result["out"] = result["out"][mask.bool()]
    assert got.keys() == exact.keys()
    for name in exact:
        slack = ulps if name == "out" else grad_ulps
        scale = max(1.0, scales.get(name, 1.0))
        assert_within_reference_error(name, got[name], same_dtype[name], exact[name], slack, scale)


@pytest.mark.parametrize("case", HF_CASES, ids=str)
@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_matches_transformers_deberta(backend, dtype, ulps, case):
    _check_against_transformers(case, dtype, ulps, _grad_ulps(backend, dtype, ulps))


@pytest.mark.parametrize("case", LONG_HF_CASES, ids=str)
@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_long_sequences_match_transformers_deberta_on_the_reference_path(monkeypatch, dtype, ulps, case):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _check_against_transformers(case, dtype, ulps, ulps)


@pytest.mark.parametrize(
    "seq_q, seq_k, buckets, max_position",
    [(1, 1, 8, 32), (70, 70, 8, 32), (300, 300, 256, 512), (1024, 1024, 16, 64), (37, 90, 8, 32), (90, 37, -1, 24)],
)
def test_relative_position_index_is_transformers_buckets(seq_q, seq_k, buckets, max_position):
    span = buckets if buckets > 0 else max_position
    index = relative_position_index(seq_q, seq_k, span, buckets, max_position, torch.device("cpu"))
    expected = (_transformers_buckets(seq_q, seq_k, buckets, max_position) + span).clamp(0, 2 * span - 1)
    assert index.dtype == torch.int32 and index.shape == (seq_q + seq_k - 1,)
    assert torch.equal(index.long()[_distances(seq_q, seq_k)], expected)


def test_calls_share_one_index_which_inference_mode_does_not_taint():
    # every layer of a model reads the same read-only index instead of making it again;
    # made first under inference_mode, it can still be saved for a later backward
    disentangled_module._cached_index.cache_clear()
    q, k, v = (torch.randn(2, 2, 9, 8) for _ in range(3))
    pk, pq = (torch.randn(2, 16, 8) for _ in range(2))
    positions = dict(position_buckets=8, max_relative_positions=32)
    with torch.inference_mode():
        first = disentangled_attention(q, k, v, pk, pq, **positions)
    assert disentangled_module._cached_index.cache_info().currsize == 1
    leaves = [x.clone().requires_grad_() for x in (q, k, v, pk, pq)]
    again = disentangled_attention(*leaves, **positions)
    again.sum().backward()
    assert disentangled_module._cached_index.cache_info().hits >= 1
    torch.testing.assert_close(again.detach(), first, rtol=0, atol=0)
    index = disentangled_module._shared_index(9, 9, 8, 8, 32, torch.device("cpu"))
    assert torch.equal(index, relative_position_index(9, 9, 8, 8, 32, torch.device("cpu")))


def test_a_fake_tensor_mode_does_not_leave_its_index_to_later_calls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    disentangled_module._cached_index.cache_clear()
    inputs = [torch.randn(2, 2, 9, 8) for _ in range(3)] + [torch.randn(2, 16, 8) for _ in range(2)]
    positions = dict(position_buckets=8, max_relative_positions=32)
    with FakeTensorMode() as mode:
        disentangled_attention(*(mode.from_tensor(x) for x in inputs), **positions)
    assert disentangled_module._cached_index.cache_info().currsize == 0
    disentangled_attention(*inputs, **positions)  # real tensors after the fake ones


class _HostToDeviceCopies(TorchDispatchMode):
    """Records the ops that copy a host tensor to another device."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        copies = func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
        inputs = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        outputs = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
        if copies and any(x.is_cpu for x in inputs) and any(not x.is_cpu for x in outputs):
            self.copies.append(str(func))
        return out


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_a_call_copies_nothing_from_the_host(varlen):
    # a pageable host-to-device copy waits for the GPU: one per call (the log buckets' constant)
    # stalled every DeBERTa layer's forward until the device drained (an H200's profile)
    shape = (128, 4, 32) if varlen else (2, 4, 64, 32)
    q, k, v = (torch.randn(shape, device="meta", requires_grad=True) for _ in range(3))
    pk, pq = (torch.randn(4, 32, 32, device="meta", requires_grad=True) for _ in range(2))
    positions = dict(position_buckets=16, max_relative_positions=64)
    with _HostToDeviceCopies() as mode:
        if varlen:
            cu = torch.tensor([0, 50, 128], dtype=torch.int32, device="meta")
            out = varlen_disentangled_attention(q, k, v, cu, 78, pk, pq, **positions)
        else:
            out = disentangled_attention(q, k, v, pk, pq, **positions)
        out.sum().backward()
    assert mode.copies == []


# ----------------------------------------------------------------------------- a dense oracle


def _distances(seq_q: int, seq_k: int) -> torch.Tensor:
    """(seq_q, seq_k): i − j + seq_k − 1, where ``relative_position_index`` keeps (i, j)'s row."""
    return torch.arange(seq_q)[:, None] - torch.arange(seq_k)[None, :] + seq_k - 1


def _transformers_buckets(seq_q: int, seq_k: int, buckets: int, max_position: int) -> torch.Tensor:
    """(seq_q, seq_k) bucket of i − j by transformers' ``build_relative_position``."""
    return build_relative_position(
        torch.empty(seq_q, 1), torch.empty(seq_k, 1), bucket_size=buckets, max_position=max_position
    )[0]


def _dense(q, k, v, pos_key, pos_query, buckets, max_position, masks, scale, dropout_scale=None):
    """Explicit disentangled attention with the (seq_q, seq_k) scores formed, in q's dtype
    with the softmax in at least fp32 (float64: the exact result); c2p and p2c gathered at
    transformers' buckets of i − j. ``masks`` = (key_padding_mask, query_padding_mask): a
    padded query's scores are all 0 (uniform over every key, as transformers' finfo.min);
    a row with no allowed key (by the masks, never by the scores: NaN propagates) gives 0."""
    key_padding_mask, query_padding_mask = masks
    batch, seq_q, seq_k = q.shape[0], q.shape[2], k.shape[2]
    s = q @ k.mT
    span_rows = next((pos.shape[1] for pos in (pos_key, pos_query) if pos is not None), 2)
    rows = (_transformers_buckets(seq_q, seq_k, buckets, max_position) + span_rows // 2).clamp(0, span_rows - 1)
    rows = rows.expand(*s.shape)
    if pos_key is not None:
        s = s + (q @ pos_key.mT).gather(-1, rows)
    if pos_query is not None:
        s = s + (pos_query @ k.mT).gather(-2, rows)
    s = s.to(torch.promote_types(q.dtype, torch.float32)) * scale
    allowed = torch.ones(batch, 1, 1, seq_k, dtype=torch.bool)
    if key_padding_mask is not None:
        allowed = ~key_padding_mask[:, None, None, :]
    s = s.masked_fill(~allowed, -math.inf)
    if query_padding_mask is not None:
        uniform = query_padding_mask[:, None, :, None]
        s, allowed = s.masked_fill(uniform, 0.0), allowed | uniform
    has_key = allowed.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~has_key, 0.0), dim=-1) * has_key
    if dropout_scale is not None:
        p = p * dropout_scale
    return p.to(v.dtype) @ v


@dataclass(frozen=True)
class Problem:
    """Direct inputs: (batch, heads, seq_q / seq_k, head_dim) q, k, v and the (heads, 2 · span,
    head_dim) position tensors of ``terms``. ``padding``: batch entry 0 pads its last third
    of keys, entry 1 all of them; ``uniform``: the same third of entry 0's queries and all
    of entry 1's are padded queries (``query_padding_mask``)."""

    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    terms: tuple[str, ...] = ("c2p", "p2c")
    position_buckets: int = 8
    max_relative_positions: int = 32
    padding: bool = True
    uniform: bool = False

    @property
    def span(self) -> int:
        return self.position_buckets if self.position_buckets > 0 else self.max_relative_positions

    def __str__(self) -> str:
        flags = (
            "+".join(self.terms) or "no-positions",
            f"buckets{self.position_buckets}" if self.position_buckets > 0 else f"span{self.span}",
            "padding" * self.padding,
            "uniform" * self.uniform,
        )
        return "-".join([f"b{self.batch}h{self.heads}q{self.seq_q}k{self.seq_k}d{self.head_dim}", *filter(None, flags)])

    def inputs(self, dtype: torch.dtype = torch.float32) -> dict:
        gen = torch.Generator().manual_seed(0)

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)

        b, h, d = self.batch, self.heads, self.head_dim
        q, k, v = randn(b, h, self.seq_q, d), randn(b, h, self.seq_k, d), randn(b, h, self.seq_k, d)
        inputs = dict(q=q, k=k, v=v, key_padding_mask=None, query_padding_mask=None)
        inputs["pos_key"] = randn(h, 2 * self.span, d) if "c2p" in self.terms else None
        inputs["pos_query"] = randn(h, 2 * self.span, d) if "p2c" in self.terms else None
        for name, seq, flag in (
            ("key_padding_mask", self.seq_k, self.padding),
            ("query_padding_mask", self.seq_q, self.uniform),
        ):
            if flag:
                mask = torch.zeros(b, seq, dtype=torch.bool)
                mask[0, seq - seq // 3 :] = True
                mask[1:2] = True
                inputs[name] = mask
        inputs["grad"] = randn(b, h, self.seq_q, d)
        return inputs

    def kwargs(self, inputs: dict) -> dict:
        return dict(
            position_buckets=self.position_buckets,
            max_relative_positions=self.max_relative_positions,
            key_padding_mask=inputs["key_padding_mask"],
            query_padding_mask=inputs["query_padding_mask"],
        )

    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim * (1 + len(self.terms)))


LEAVES = ("q", "k", "v", "pos_key", "pos_query")


def _with_grads(fn, inputs: dict) -> dict[str, torch.Tensor]:
    """fn(q, k, v, pos_key, pos_query) and the gradients of the five for ``inputs['grad']``."""
    leaves = {name: None if inputs[name] is None else inputs[name].detach().clone().requires_grad_() for name in LEAVES}
    out = fn(*leaves.values())
    out.backward(inputs["grad"])
    return {"out": out.detach(), **{f"d{name}": x.grad for name, x in leaves.items() if x is not None}}


def _ours(problem: Problem, inputs: dict, dropout_p: float = 0.0) -> dict[str, torch.Tensor]:
    return _with_grads(
        lambda q, k, v, pk, pq: disentangled_attention(q, k, v, pk, pq, dropout_p=dropout_p, **problem.kwargs(inputs)),
        inputs,
    )


def _dense_grads(problem: Problem, inputs: dict, dtype: torch.dtype, dropout_scale=None) -> dict[str, torch.Tensor]:
    """_dense's output and gradients with q, k, v, the positions and grad cast to ``dtype``."""
    masks = inputs["key_padding_mask"], inputs["query_padding_mask"]
    cast = {name: None if inputs[name] is None else inputs[name].to(dtype) for name in (*LEAVES, "grad")}
    dropout_scale = None if dropout_scale is None else dropout_scale.to(dtype)
    return _with_grads(
        lambda q, k, v, pk, pq: _dense(
            q,
            k,
            v,
            pk,
            pq,
            problem.position_buckets,
            problem.max_relative_positions,
            masks,
            problem.scale(),
            dropout_scale,
        ),  # fmt: skip
        cast,
    )


def _check_against_dense(problem: Problem, dtype, ulps, dropout_p: float = 0.0) -> None:
    inputs = problem.inputs(dtype)
    torch.manual_seed(1234)
    got = _ours(problem, inputs, dropout_p)
    dropout_scale = None
    if dropout_p:
        torch.manual_seed(1234)
        shape = (problem.batch, problem.heads, problem.seq_q, problem.seq_k)
        dropout_scale = _keep(shape, dropout_p, "cpu") * dropout_threshold(dropout_p)[1]
    exact = _dense_grads(problem, inputs, torch.float64, dropout_scale)
    same_dtype = _dense_grads(problem, inputs, dtype, dropout_scale)
    assert got.keys() == exact.keys()
    for name in exact:
        assert_within_reference_error(name, got[name], same_dtype[name], exact[name], ulps)


CROSS_PROBLEMS = [
    Problem(2, 2, 17, 45, 16),
    Problem(2, 1, 45, 17, 32, ("c2p",), position_buckets=-1, max_relative_positions=20, uniform=True),
    Problem(1, 2, 1, 33, 16, ("p2c",)),
    Problem(1, 2, 33, 1, 16, padding=False),
]
# reference path only: several query blocks of the reference against longer keys
LONG_CROSS_PROBLEMS = [Problem(2, 2, 300, 129, 24, position_buckets=16, max_relative_positions=64, uniform=True)]


@pytest.mark.parametrize("problem", CROSS_PROBLEMS, ids=str)
def test_seq_q_other_than_seq_k_matches_the_dense_oracle(backend, problem):
    _check_against_dense(problem, torch.float32, FP32_ULPS)


@pytest.mark.parametrize("problem", LONG_CROSS_PROBLEMS, ids=str)
def test_long_seq_q_other_than_seq_k_on_the_reference_path(monkeypatch, problem):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _check_against_dense(problem, torch.float32, FP32_ULPS)


# ----------------------------------------------------------------------------- interpreter vs reference


def _on_both_paths(monkeypatch, run):
    """run() through the interpreted kernels, then through the PyTorch reference."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels are compiled for the GPU in this session")
    kernels = run()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    return kernels, run()


AGREEMENT_PROBLEMS = [
    (Problem(2, 2, 70, 70, 16, uniform=True), 0.0),
    (Problem(2, 2, 70, 45, 32, position_buckets=-1, max_relative_positions=24, uniform=True), 0.25),
    (Problem(1, 3, 33, 80, 40, ("c2p",), position_buckets=16, max_relative_positions=64), 0.1),
    (Problem(2, 1, 17, 17, 80, ("p2c",)), 0.5),
    # head_dim over 128: 16-row tiles
    (Problem(1, 2, 40, 29, 144, position_buckets=4, max_relative_positions=16), 0.2),
    (Problem(2, 2, 33, 33, 16, ()), 0.3),
]


@pytest.mark.parametrize(
    "problem, dropout_p", AGREEMENT_PROBLEMS, ids=lambda x: str(x) if isinstance(x, Problem) else f"p{x}"
)
def test_interpreted_kernels_agree_with_the_reference(monkeypatch, problem, dropout_p):
    # the same Philox seed (torch's next draw) on both paths: the same dropout mask,
    # regenerated from the seed in both backwards
    inputs = problem.inputs()

    def run():
        torch.manual_seed(99)
        return _ours(problem, inputs, dropout_p)

    kernels, reference = _on_both_paths(monkeypatch, run)
    for name in reference:
        torch.testing.assert_close(kernels[name], reference[name], rtol=1e-5, atol=1e-5, msg=name)


# ----------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_dropout_forward_and_gradient_use_the_same_mask(backend, dtype, ulps):
    # odd lengths (partial tiles), both terms, padded keys and queries: the mask drawn from
    # torch's seed (Philox stream b · heads + h) in the forward and again in the backward
    _check_against_dense(Problem(2, 2, 45, 37, 16, uniform=True), dtype, ulps, dropout_p=0.25)


def test_dropout_mask_is_philox_of_torch_seed(backend):
    # q = k = 0 and zero positions give every key weight 1 / seq_k, and v = I lays each
    # row's keep decisions out in the output: out[..., i, j] = keep_ij · scale / seq_k
    batch, heads, seq_q, seq_k, p = 1, 2, 48, 64, 0.3
    q = torch.zeros(batch, heads, seq_q, seq_k)
    k = torch.zeros(batch, heads, seq_k, seq_k)
    v = torch.eye(seq_k).expand(batch, heads, seq_k, seq_k)
    positions = torch.zeros(heads, 16, seq_k)
    torch.manual_seed(7)
    out = disentangled_attention(
        q, k, v, positions, positions, position_buckets=8, max_relative_positions=32, dropout_p=p
    )
    torch.manual_seed(7)
    expected = _keep(out.shape, p, "cpu")
    kept = out / dropout_threshold(p)[1] * seq_k
    torch.testing.assert_close(kept, expected.float(), rtol=0, atol=1e-5)
    threshold = dropout_threshold(p)[0]
    assert abs(kept.mean().item() - (1 - threshold / 256)) < 0.025


def test_dropout_reproducible_from_torch_seed(backend):
    problem = Problem(1, 2, 40, 40, 16)
    inputs = problem.inputs()
    torch.manual_seed(3)
    first = _ours(problem, inputs, 0.5)
    torch.manual_seed(3)
    second = _ours(problem, inputs, 0.5)
    third = _ours(problem, inputs, 0.5)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not torch.equal(first["out"], third["out"])


# ----------------------------------------------------------------------------- float64


def test_float64_runs_the_reference_and_passes_gradcheck():
    # float64 takes the PyTorch reference on either path; padded keys and queries
    problem = Problem(2, 2, 5, 6, 4, position_buckets=4, max_relative_positions=8, uniform=True)
    inputs = problem.inputs(torch.float64)
    leaves = [inputs[name].requires_grad_() for name in LEAVES]

    def ours(q, k, v, pk, pq):
        return disentangled_attention(q, k, v, pk, pq, **problem.kwargs(inputs))

    assert torch.autograd.gradcheck(ours, leaves)
    masks = inputs["key_padding_mask"], inputs["query_padding_mask"]
    expected = _dense(*leaves, 4, 8, masks, problem.scale())
    torch.testing.assert_close(ours(*leaves), expected, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize(
    "batch, seq_q, seq_k",
    [
        pytest.param(0, 5, 5, id="batch0"),
        pytest.param(1, 0, 0, id="seq0"),
        pytest.param(2, 0, 7, id="seq_q0"),
        pytest.param(2, 5, 0, id="seq_k0"),
    ],
)
def test_empty_inputs_give_zeros(backend, batch, seq_q, seq_k):
    q = torch.randn(batch, 2, seq_q, 8, requires_grad=True)
    k, v = (torch.randn(batch, 2, seq_k, 8, requires_grad=True) for _ in range(2))
    pos_key, pos_query = (torch.randn(2, 8, 8, requires_grad=True) for _ in range(2))
    out = disentangled_attention(q, k, v, pos_key, pos_query, position_buckets=4, max_relative_positions=16)
    assert out.shape == q.shape and not out.any()
    out.sum().backward()
    for x in (q, k, v, pos_key, pos_query):
        assert x.grad.shape == x.shape and not x.grad.any()


def test_a_batch_entry_with_every_key_padded_gives_zeros(backend):
    # Problem's padding leaves entry 1 no key: its output is 0 and it has no gradient;
    # entry 0 matches the dense oracle
    problem = Problem(2, 2, 33, 33, 16)
    inputs = problem.inputs()
    got = _ours(problem, inputs)
    assert not got["out"][1].any()
    for name in ("dq", "dk", "dv"):
        assert got[name].isfinite().all() and not got[name][1].any(), name
    exact = _dense_grads(problem, inputs, torch.float64)
    same_dtype = _dense_grads(problem, inputs, torch.float32)
    for name in exact:
        assert_within_reference_error(name, got[name], same_dtype[name], exact[name], FP32_ULPS)


def test_padded_queries_average_every_value_alike(backend):
    # query_padding_mask: a row's scores are constants, padded keys included (transformers'
    # finfo.min rows); its output is the mean of every value and gives only dV, each value
    # 1 / seq_k of the row's upstream gradient
    problem = Problem(2, 2, 20, 20, 16, uniform=True)
    inputs = problem.inputs()
    got = _ours(problem, inputs)
    uniform = inputs["query_padding_mask"]
    mean = inputs["v"].mean(-2, keepdim=True).expand_as(inputs["q"])
    torch.testing.assert_close(got["out"][uniform[:, None].expand(-1, 2, -1)], mean[uniform[:, None].expand(-1, 2, -1)])
    assert not got["dq"][1].any() and not got["dq"][0, :, uniform[0]].any()
    torch.testing.assert_close(got["dv"][1], inputs["grad"][1].sum(-2, keepdim=True).expand_as(got["dv"][1]) / 20)


def test_nan_in_query_propagates_like_the_dense_oracle(backend):
    # a NaN in row 3 of (batch 0, head 1) poisons that row's output and, through its dS,
    # every key of that head; nothing of another head or batch entry. Position rows that
    # no distance of the row reads may or may not get NaN · 0 (the oracle's dense products
    # do): only the clean head of the position gradients is compared.
    problem = Problem(2, 2, 7, 9, 16, padding=False)
    inputs = problem.inputs()
    inputs["q"][0, 1, 3, 5] = math.nan
    got = _ours(problem, inputs)
    expected = _dense_grads(problem, inputs, torch.float32)
    assert got["out"].isnan().any(-1).nonzero().tolist() == [[0, 1, 3]]
    for name in ("out", "dq", "dk", "dv"):
        assert torch.equal(got[name].isnan(), expected[name].isnan()), f"{name}: NaN pattern differs"
        finite = expected[name].isfinite()
        torch.testing.assert_close(got[name][finite], expected[name][finite], msg=name)
    for name in ("dpos_key", "dpos_query"):
        assert got[name][1].isnan().any(), name
        torch.testing.assert_close(got[name][0], expected[name][0], msg=name)


def test_head_views_of_fused_projections_match_contiguous_inputs(backend):
    # q, k, v as head views of one (batch, seq, 3 · hidden) projection and the positions as
    # views of one (2 · span, 2 · hidden) projection: strided rows, no copies; a value with
    # head_dim strided (a transpose) takes a copy
    problem = Problem(2, 3, 33, 33, 16)
    batch, heads, seq, head_dim, span = 2, 3, 33, 16, 8
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(batch, seq, 3 * heads * head_dim, generator=gen)
    positions = torch.randn(2 * span, 2 * heads * head_dim, generator=gen)
    inputs = problem.inputs()
    q, k, v = rearrange(qkv, "b s (three h d) -> three b h s d", three=3, h=heads).unbind(0)
    inputs.update(q=q, k=k, v=v.contiguous().transpose(-1, -2).contiguous().transpose(-1, -2))
    pos_key, pos_query = rearrange(positions, "p (two h d) -> two h p d", two=2, h=heads).unbind(0)
    inputs.update(pos_key=pos_key, pos_query=pos_query)
    assert q.stride(-1) == 1 and not q.is_contiguous() and not pos_key.is_contiguous()
    assert inputs["v"].stride(-1) != 1
    strided = _ours(problem, inputs)
    contiguous = _ours(problem, {name: x if x is None else x.contiguous() for name, x in inputs.items()})
    for name in contiguous:
        torch.testing.assert_close(strided[name], contiguous[name], rtol=1e-6, atol=1e-6, msg=name)


def test_output_merges_heads_as_a_view(backend):
    problem = Problem(2, 3, 9, 9, 8)
    inputs = problem.inputs()
    out = disentangled_attention(*(inputs[name] for name in LEAVES), **problem.kwargs(inputs))
    merged = rearrange(out, "b h s d -> b s (h d)")
    assert merged.data_ptr() == out.data_ptr() and merged.is_contiguous()


def test_without_positions_it_is_plain_attention(backend):
    problem = Problem(2, 2, 33, 33, 16, ())
    inputs = problem.inputs()
    ours = _ours(problem, inputs)
    plain = _with_grads(lambda q, k, v, pk, pq: attention(q, k, v, key_padding_mask=inputs["key_padding_mask"]), inputs)
    for name in plain:
        torch.testing.assert_close(ours[name], plain[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("terms", [(), ("c2p",), ("p2c",), ("c2p", "p2c")], ids=lambda t: "+".join(t) or "none")
def test_default_scale_is_debertas(terms):
    # 1 / sqrt(head_dim · (1 + number of position terms)), as transformers' scale_factor
    problem = Problem(1, 2, 9, 9, 12, terms, padding=False)
    inputs = problem.inputs()
    args = [inputs[name] for name in LEAVES]
    default = disentangled_attention(*args, **problem.kwargs(inputs))
    explicit = disentangled_attention(*args, **problem.kwargs(inputs), scale=1.0 / math.sqrt(12 * (1 + len(terms))))
    assert torch.equal(default, explicit)


def test_keeps_nothing_quadratic(backend):
    # what backward keeps beyond q, k, v, the positions and the output grows linearly in
    # seq: the lse, the seed and the (seq_q + seq_k − 1) position index
    kept = {}
    for seq in (64, 128):
        problem = Problem(1, 2, seq, seq, 16, uniform=True)
        inputs = problem.inputs()
        leaves = [inputs[name].requires_grad_() for name in LEAVES]
        memory = measure_activation_memory(
            lambda: disentangled_attention(*leaves, dropout_p=0.1, **problem.kwargs(inputs)), exclude=leaves
        )
        kept[seq] = memory.saved_bytes
        assert all(math.prod(record.shape) < seq * seq for record in memory.saved), memory.saved
    assert kept[128] <= 2 * kept[64]


# ----------------------------------------------------------------------------- errors


def _small(**overrides) -> dict:
    tensors = dict(
        query=torch.randn(2, 4, 8, 16),
        key=torch.randn(2, 4, 9, 16),
        value=torch.randn(2, 4, 9, 16),
        pos_key=torch.randn(4, 16, 16),
        pos_query=torch.randn(4, 16, 16),
    )
    tensors.update(overrides)
    return tensors


BAD_INPUTS = [
    (_small(query=[[0.0]]), {}, TypeError, "query must be a torch.Tensor, got list"),
    (_small(query=torch.randn(2, 8, 16)), {}, ValueError, "query must be 4-d, got shape (2, 8, 16)"),
    (
        _small(query=torch.ones(2, 4, 8, 16, dtype=torch.int32)),
        {},
        TypeError,
        "query must be float16, bfloat16, float32 or float64, got torch.int32",
    ),
    (_small(key=None), {}, TypeError, "key must be a torch.Tensor, got NoneType"),
    (_small(key=torch.randn(2, 4, 9)), {}, ValueError, "key must be 4-d, got shape (2, 4, 9)"),
    (
        _small(key=torch.randn(2, 4, 9, 16, dtype=torch.float16)),
        {},
        TypeError,
        "key must have query's dtype torch.float32, got torch.float16",
    ),
    (
        _small(value=torch.randn(2, 4, 9, 16, device="meta")),
        {},
        ValueError,
        "value must be on query's device cpu, got meta",
    ),
    (
        _small(key=torch.randn(3, 4, 9, 16), value=torch.randn(3, 4, 9, 16)),
        {},
        ValueError,
        "key must be (batch, heads, seq_k, head_dim) = (2, 4, seq_k, 16), got (3, 4, 9, 16)",
    ),
    (_small(key=torch.randn(2, 2, 9, 16), value=torch.randn(2, 2, 9, 16)), {}, ValueError, "key must be (batch, heads"),
    (
        _small(key=torch.randn(2, 4, 9, 8), value=torch.randn(2, 4, 9, 8)),
        {},
        ValueError,
        "= (2, 4, seq_k, 16), got (2, 4, 9, 8)",
    ),
    (
        _small(value=torch.randn(2, 4, 10, 16)),
        {},
        ValueError,
        "value must have key's shape (2, 4, 9, 16), got (2, 4, 10, 16)",
    ),
    (
        {name: torch.randn(1, 1, 2, 257) for name in ("query", "key", "value")},
        {},
        ValueError,
        "head_dim must be in [1, 256], got 257",
    ),
    (
        {name: torch.randn(1, 1, 2, 0) for name in ("query", "key", "value")},
        {},
        ValueError,
        "head_dim must be in [1, 256], got 0",
    ),
    (_small(), {"position_buckets": 8.0}, TypeError, "position_buckets must be an int, got float 8.0"),
    (_small(), {"position_buckets": True}, TypeError, "position_buckets must be an int, got bool True"),
    (_small(), {"max_relative_positions": "32"}, TypeError, "max_relative_positions must be an int, got str '32'"),
    (_small(pos_key=[0.0]), {}, TypeError, "pos_key must be a torch.Tensor, got list"),
    (_small(pos_key=torch.randn(16, 16)), {}, ValueError, "pos_key must be 3-d, got shape (16, 16)"),
    (
        _small(pos_key=torch.randn(4, 16, 16, dtype=torch.bfloat16)),
        {},
        TypeError,
        "pos_key must have query's dtype torch.float32, got torch.bfloat16",
    ),
    (
        _small(pos_query=torch.randn(4, 16, 16, device="meta")),
        {},
        ValueError,
        "pos_query must be on query's device cpu",
    ),
    (
        _small(pos_key=torch.randn(3, 16, 16)),
        {},
        ValueError,
        "pos_key must be (heads, 2 · span, head_dim) = (4, 2 · span, 16), got (3, 16, 16)",
    ),
    (_small(pos_query=torch.randn(4, 15, 16)), {}, ValueError, "pos_query must be (heads, 2 · span, head_dim)"),
    (_small(pos_query=torch.randn(4, 0, 16)), {}, ValueError, "pos_query must be (heads, 2 · span, head_dim)"),
    (_small(pos_query=torch.randn(4, 16, 8)), {}, ValueError, "= (4, 2 · span, 16), got (4, 16, 8)"),
    (
        _small(pos_query=torch.randn(4, 8, 16)),
        {},
        ValueError,
        "pos_key and pos_query must have the same rows, got 16 and 8",
    ),
    (
        _small(),
        {"position_buckets": 16, "max_relative_positions": 64},
        ValueError,
        "position tensors must have 2 · position_buckets = 32 rows, got 16",
    ),
    (_small(pos_key=None), {"position_buckets": 4}, ValueError, "2 · position_buckets = 8 rows, got 16"),
    (_small(), {"key_padding_mask": [[False] * 9] * 2}, TypeError, "key_padding_mask must be a torch.Tensor, got list"),
    (
        _small(),
        {"key_padding_mask": torch.zeros(9, dtype=torch.bool)},
        ValueError,
        "key_padding_mask must be 2-d, got shape (9,)",
    ),
    (
        _small(),
        {"key_padding_mask": torch.zeros(2, 9)},
        TypeError,
        "key_padding_mask must be bool (True = padding), got torch.float32",
    ),
    (
        _small(),
        {"key_padding_mask": torch.zeros(2, 8, dtype=torch.bool)},
        ValueError,
        "key_padding_mask must be (batch, seq_k) = (2, 9), got (2, 8)",
    ),
    (
        _small(),
        {"key_padding_mask": torch.zeros(2, 9, dtype=torch.bool, device="meta")},
        ValueError,
        "key_padding_mask must be on query's device cpu, got meta",
    ),
    (_small(), {"query_padding_mask": (False,) * 8}, TypeError, "query_padding_mask must be a torch.Tensor, got tuple"),
    (
        _small(),
        {"query_padding_mask": torch.zeros(2, 1, 8, dtype=torch.bool)},
        ValueError,
        "query_padding_mask must be 2-d, got shape (2, 1, 8)",
    ),
    (
        _small(),
        {"query_padding_mask": torch.zeros(2, 8, dtype=torch.uint8)},
        TypeError,
        "query_padding_mask must be bool (True = padding), got torch.uint8",
    ),
    (
        _small(),
        {"query_padding_mask": torch.zeros(2, 9, dtype=torch.bool)},
        ValueError,
        "query_padding_mask must be (batch, seq_q) = (2, 8), got (2, 9)",
    ),
    (
        _small(),
        {"query_padding_mask": torch.zeros(2, 8, dtype=torch.bool, device="meta")},
        ValueError,
        "query_padding_mask must be on query's device cpu, got meta",
    ),
    (_small(), {"dropout_p": 1.0}, ValueError, "dropout_p must be a float in [0, 1), got 1.0"),
    (_small(), {"dropout_p": -0.1}, ValueError, "dropout_p must be a float in [0, 1), got -0.1"),
    (_small(), {"dropout_p": math.nan}, ValueError, "dropout_p must be a float in [0, 1), got nan"),
    (_small(), {"dropout_p": True}, TypeError, "dropout_p must be a float in [0, 1), got bool True"),
    (_small(), {"dropout_p": "0.1"}, TypeError, "dropout_p must be a float in [0, 1), got str '0.1'"),
    (_small(), {"scale": "0.5"}, TypeError, "scale must be a real number or None, got str"),
    (_small(), {"scale": True}, TypeError, "scale must be a real number or None, got bool"),
]


@pytest.mark.parametrize("tensors, kwargs, error, message", BAD_INPUTS)
def test_bad_input_raises(tensors, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        disentangled_attention(**tensors, **kwargs)


# ----------------------------------------------------------------------------- custom ops


@pytest.mark.parametrize(
    "problem, dtype, dropout_p",
    [
        (Problem(2, 3, 11, 11, 8, position_buckets=4, max_relative_positions=16), torch.float32, 0.0),
        (
            Problem(2, 3, 11, 7, 8, ("c2p",), position_buckets=4, max_relative_positions=16, uniform=True),
            torch.bfloat16,
            0.25,
        ),
        (Problem(2, 3, 7, 11, 8, ("p2c",), position_buckets=-1, max_relative_positions=6), torch.float32, 0.25),
    ],
    ids=["fp32", "c2p-uniform-bf16-dropout", "p2c-dropout"],
)
def test_ops_pass_opcheck(monkeypatch, problem, dtype, dropout_p):
    # schema, fake (meta) functions, autograd registration and AOT dispatch of the forward
    # op; the backward op on its own (it has no autograd of its own)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inputs = problem.inputs(dtype)
    tensors = [None if inputs[name] is None else inputs[name].requires_grad_() for name in LEAVES]
    index = relative_position_index(
        problem.seq_q, problem.seq_k, problem.span, problem.position_buckets, problem.max_relative_positions,
        torch.device("cpu"),
    )  # fmt: skip
    seed = new_dropout_seed(torch.device("cpu")) if dropout_p else None
    masks = inputs["key_padding_mask"], inputs["query_padding_mask"]
    args = (*tensors, index, *masks, seed, dropout_p, problem.scale())
    torch.library.opcheck(torch.ops.slimformer.disentangled_attention.default, args)
    out, lse = torch.ops.slimformer.disentangled_attention(*args)
    detached = [None if x is None else x.detach() for x in tensors]
    backward_args = (inputs["grad"], *detached, index, out.detach(), lse, *masks, seed, dropout_p, problem.scale())
    torch.library.opcheck(torch.ops.slimformer.disentangled_attention_backward.default, backward_args)


# ----------------------------------------------------------------------------- varlen

# lengths with an empty sequence, one past the 32-row tiles and one of a single token
VARLEN_LENGTHS = [5, 0, 37, 1, 20]


def _packed(lengths, heads=2, head_dim=16, rows=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    q, k, v = (torch.randn(total, heads, head_dim, generator=gen).to(dtype) for _ in range(3))
    pk, pq = (torch.randn(heads, rows, head_dim, generator=gen).to(dtype) for _ in range(2))
    return dict(
        q=q, k=k, v=v, pos_key=pk, pos_query=pq, grad=torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    ), cu


def _varlen(inputs, cu, max_seqlen, dropout_p=0.0, position_buckets=8, max_relative_positions=32):
    """``_packed``'s position tensors have 2 · position_buckets rows."""
    return _with_grads(
        lambda q, k, v, pk, pq: varlen_disentangled_attention(
            q,
            k,
            v,
            cu,
            max_seqlen,
            pk,
            pq,
            position_buckets=position_buckets,
            max_relative_positions=max_relative_positions,
            dropout_p=dropout_p,
        ),  # fmt: skip
        inputs,
    )


def test_varlen_is_the_dense_call_on_each_sequence(backend):
    inputs, cu = _packed(VARLEN_LENGTHS)
    got = _varlen(inputs, cu, max(VARLEN_LENGTHS) + 3)  # max_seqlen above the longest: the same result
    expected = {name: torch.zeros_like(x) for name, x in got.items()}
    for start, stop in itertools.pairwise(cu.tolist()):
        if start == stop:
            continue
        rows = slice(start, stop)
        one = {name: rearrange(inputs[name][rows], "l h d -> 1 h l d") for name in ("q", "k", "v", "grad")}
        dense = _with_grads(
            lambda q, k, v, pk, pq: disentangled_attention(
                q, k, v, pk, pq, position_buckets=8, max_relative_positions=32
            ),
            {**one, "pos_key": inputs["pos_key"], "pos_query": inputs["pos_query"]},
        )
        for name in ("out", "dq", "dk", "dv"):
            expected[name][rows] = rearrange(dense[name], "1 h l d -> l h d")
        for name in ("dpos_key", "dpos_query"):
            expected[name] += dense[name]
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)


def test_varlen_interpreted_kernels_agree_with_the_reference_with_dropout(monkeypatch):
    inputs, cu = _packed(VARLEN_LENGTHS, head_dim=32)

    def run():
        torch.manual_seed(7)
        return _varlen(inputs, cu, max(VARLEN_LENGTHS), dropout_p=0.2)

    kernels, reference = _on_both_paths(monkeypatch, run)
    for name in reference:
        torch.testing.assert_close(kernels[name], reference[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "cu, max_seqlen, error, message",
    [
        (torch.tensor([0, 5, 60], dtype=torch.int32), 63, ValueError, r"cu_seqlens\[-1\] must equal query's"),
        (torch.tensor([1, 63], dtype=torch.int32), 63, ValueError, "cu_seqlens must start at 0"),
        (torch.tensor([0, 40, 63], dtype=torch.int32), 30, ValueError, "must be at least its longest sequence 40"),
        (torch.tensor([0, 63]), 63, TypeError, "cu_seqlens must have query's dtype torch.int32"),
        (torch.tensor([0, 63], dtype=torch.int32), 0, ValueError, "max_seqlen must be >= 1, got 0"),
    ],
)
def test_varlen_bad_cu_seqlens_raise(cu, max_seqlen, error, message):
    inputs, _ = _packed(VARLEN_LENGTHS)
    with pytest.raises(error, match=message):
        varlen_disentangled_attention(inputs["q"], inputs["k"], inputs["v"], cu, max_seqlen)


# ----------------------------------------------------------------------------- GPU

# DeBERTa-v3-base's attention (256 buckets, both terms, padded keys and queries), odd
# lengths past the 32-row tiles, one term alone, head_dim 128 (16-row tiles), unbucketed
GPU_PROBLEMS = [
    Problem(2, 12, 512, 512, 64, position_buckets=256, max_relative_positions=512, uniform=True),
    Problem(2, 4, 300, 257, 64, ("c2p",), position_buckets=32, max_relative_positions=128, uniform=True),
    Problem(2, 2, 129, 129, 128, ("p2c",), position_buckets=-1, max_relative_positions=48),
    Problem(3, 2, 70, 70, 32, uniform=True),
]


def _on_gpu(inputs: dict) -> dict:
    return {name: None if x is None else x.cuda() for name, x in inputs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("problem", GPU_PROBLEMS, ids=str)
@pytest.mark.parametrize("dtype, ulps", DTYPES)
@pytest.mark.parametrize("dropout_p", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_compiled_kernels_match_the_dense_oracle_on_gpu(problem, dtype, ulps, dropout_p):
    # the compiled kernels (tl.gather's shuffles, wgmma, the position gradients' atomics)
    # against fp64 on the CPU, with the mask the kernels drew from torch's CUDA seed
    in_fp32 = dropout_p and dtype != torch.float32 and problem.head_dim > 64  # its 16-bit kernels gave wrong outputs
    with pytest.warns(UserWarning, match="runs in float32") if in_fp32 else contextlib.nullcontext():
        _check_compiled_against_the_oracle(problem, dtype, ulps, dropout_p)


def _check_compiled_against_the_oracle(problem: Problem, dtype: torch.dtype, ulps: float, dropout_p: float) -> None:
    inputs = problem.inputs(dtype)
    torch.manual_seed(1234)
    got = {name: x.cpu() for name, x in _ours(problem, _on_gpu(inputs), dropout_p).items()}
    dropout_scale = None
    if dropout_p:
        torch.manual_seed(1234)
        shape = (problem.batch, problem.heads, problem.seq_q, problem.seq_k)
        dropout_scale = _keep(shape, dropout_p, "cuda").cpu() * dropout_threshold(dropout_p)[1]
    exact = _dense_grads(problem, inputs, torch.float64, dropout_scale)
    same_dtype = _dense_grads(problem, inputs, dtype, dropout_scale)
    grad_ulps = KERNEL_16BIT_GRAD_ULPS if dtype != torch.float32 else ulps
    for name in exact:
        assert_within_reference_error(
            name, got[name], same_dtype[name], exact[name], ulps if name == "out" else grad_ulps
        )


# The 16-bit kernels with dropout at head_dim 128 (16-row tiles) gave outputs far off the
# oracle on an H200, where fp32 at the same tiles, 16-bit without dropout and 16-bit at 32-row
# tiles agreed; the public functions run such calls in fp32. These run the 16-bit kernels past
# that fallback, one factor changed each, to find the cause; the H200's case is a strict xfail
# (an XPASS says the fallback can go).
_D128 = dict(batch=2, heads=2, seq_q=129, seq_k=129, head_dim=128, terms=("p2c",), position_buckets=-1)
SIXTEEN_ROW_CASES = [
    pytest.param(
        Problem(**_D128, max_relative_positions=48), None, id="h200-case", marks=pytest.mark.xfail(strict=True)
    ),
    pytest.param(Problem(**_D128, max_relative_positions=48), (32, 4, 1), id="d128-32-row-tiles"),
    pytest.param(Problem(**{**_D128, "head_dim": 64}, max_relative_positions=48), (16, 4, 1), id="d64-16-row-tiles"),
    pytest.param(Problem(**{**_D128, "terms": ()}, max_relative_positions=48), None, id="d128-no-positions"),
    pytest.param(Problem(**{**_D128, "terms": ("c2p",)}, max_relative_positions=48), None, id="d128-c2p"),
    pytest.param(Problem(**_D128, max_relative_positions=48, padding=False), None, id="d128-no-padding"),
    pytest.param(Problem(**_D128, max_relative_positions=48), (16, 8, 1), id="d128-8-warps"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("problem, blocks", SIXTEEN_ROW_CASES)
def test_16bit_kernels_with_dropout_past_the_fp32_fallback(monkeypatch, problem, blocks):
    monkeypatch.setattr(disentangled_module, "_in_verified_dtype", lambda dropout_p, *tensors: list(tensors))
    if blocks is not None:
        monkeypatch.setattr(disentangled_module, "_blocks", lambda q, backward: blocks)
    _check_compiled_against_the_oracle(problem, torch.float16, 1.0, 0.1)  # fp16 at DTYPES' 1 ulp


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_varlen_kernels_match_the_reference_on_gpu(monkeypatch, dtype):
    # DeBERTa-v3-base's heads at unequal lengths past the tiles, against the PyTorch reference on the CPU
    lengths = [300, 0, 17, 512, 1]
    inputs, cu = _packed(lengths, heads=12, head_dim=64, rows=512, dtype=dtype)
    on_gpu = {name: x.cuda() for name, x in inputs.items()}
    positions = dict(position_buckets=256, max_relative_positions=512)
    got = {name: x.cpu().float() for name, x in _varlen(on_gpu, cu.cuda(), 512, **positions).items()}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    expected = _varlen({name: x.float() for name, x in inputs.items()}, cu, 512, **positions)
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name in expected:
        scale = expected[name].abs().max().item()
        torch.testing.assert_close(got[name] / scale, expected[name] / scale, **tolerance, msg=name)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"position_buckets": 1}, ValueError, "position_buckets must be <= 0 (no buckets) or >= 2, got 1"),
        ({"position_buckets": True}, TypeError, "position_buckets must be an int, got bool True"),
        ({"position_buckets": 8.0}, TypeError, "position_buckets must be an int, got float 8.0"),
        ({"max_relative_positions": "64"}, TypeError, "max_relative_positions must be an int, got str '64'"),
        (
            {"position_buckets": 8, "max_relative_positions": 5},
            ValueError,
            "max_relative_positions must differ from position_buckets // 2 + 1 = 5 when position_buckets=8 > 0",
        ),
    ],
    ids=str,
)
@pytest.mark.parametrize("varlen", [False, True])
def test_bad_bucket_arguments_raise_naming_them(kwargs, error, message, varlen):
    tensors = _small(pos_key=torch.randn(4, 16, 16), pos_query=torch.randn(4, 16, 16))
    with pytest.raises(error, match=re.escape(message)):
        if varlen:
            q = tensors["query"][0].transpose(0, 1)
            cu = torch.tensor([0, 8], dtype=torch.int32)
            varlen_disentangled_attention(q, q, q, cu, 8, tensors["pos_key"], tensors["pos_query"], **kwargs)
        else:
            disentangled_attention(**tensors, **kwargs)


def test_bucket_arguments_take_numpy_integers():
    import numpy as np

    tensors = _small()
    expected = disentangled_attention(**tensors, position_buckets=8, max_relative_positions=32)
    got = disentangled_attention(**tensors, position_buckets=np.int64(8), max_relative_positions=np.int32(32))
    assert torch.equal(got, expected)
