"""The shapes the compile report captures: realistic calls of slimformer's public ops.

Each ``Case`` calls a public op (forward, then backward where it has one) on CPU tensors;
``capture.capture`` turns the calls into the launches a GPU would get. Cases
name no kernel and no kernel argument, so the report follows the kernels as they change.
``ci=True`` marks the small representative set the CI test compiles.
"""

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from einops import rearrange

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Case:
    """``run()`` calls the op's forward and returns its backward as a callable (or None)."""

    name: str
    family: str  # "attention", "norm", "dropout", "activation", "loss", "gemm"
    run: Callable[[], Callable[[], None] | None]
    params: dict = field(default_factory=dict)
    ci: bool = False


# ----------------------------------------------------------------------------- attention


def _attention_inputs(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype, layout):
    """q, k, v as a model would hand them over.

    fused-qkv: head views of one (batch, seq, 3 · heads · head_dim) projection, as
    ``self_attention`` and slimformer's layers make them; bshd: (batch, seq, heads,
    head_dim) projections transposed to heads-first (Hugging Face); bhsd: contiguous.
    """
    if layout == "fused-qkv":
        qkv = torch.zeros(batch, seq_q, 3 * heads * head_dim, dtype=dtype, requires_grad=True)
        return rearrange(qkv, "b s (three h d) -> three b h s d", three=3, h=heads).unbind(0)
    if layout == "bshd":
        q = torch.zeros(batch, seq_q, heads, head_dim, dtype=dtype, requires_grad=True)
        k, v = (torch.zeros(batch, seq_k, kv_heads, head_dim, dtype=dtype, requires_grad=True) for _ in range(2))
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q = torch.zeros(batch, heads, seq_q, head_dim, dtype=dtype, requires_grad=True)
    k, v = (torch.zeros(batch, kv_heads, seq_k, head_dim, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v


def attention_case(
    head_dim,
    dtype="bf16",
    *,
    seq=512,
    batch=16,
    heads=None,
    kv_heads=None,
    causal=False,
    dropout=0.0,
    mask=None,
    key_padding=False,
    layout="fused-qkv",
    deterministic=True,
    window=None,
    ci=False,
) -> Case:
    from slimformer.kernels.attention import attention

    heads = heads or max(1, 768 // head_dim)
    kv_heads = kv_heads or heads
    layout = "bshd" if kv_heads != heads and layout == "fused-qkv" else layout
    flags = [
        f"d{head_dim}", dtype, f"s{seq}", layout,
        "causal" if causal else "", f"dropout{dropout:g}" if dropout else "",
        f"{mask}-mask" if mask else "", "key-padding" if key_padding else "",
        f"gqa{heads}/{kv_heads}" if kv_heads != heads else "", "" if deterministic else "atomic-dq",
        f"window{window}" if window is not None else "",
    ]  # fmt: skip
    name = "attn " + " ".join(f for f in flags if f)

    def run():
        q, k, v = _attention_inputs(batch, heads, kv_heads, seq, seq, head_dim, DTYPES[dtype], layout)
        attn_mask = relative_bias = None
        if mask == "relative":  # MPNet's: a learned bias per head and offset j - i
            relative_bias = torch.zeros(heads, 2 * seq - 1, requires_grad=True)
        elif mask == "bool":
            attn_mask = torch.ones(seq, seq, dtype=torch.bool).tril(64)
        elif mask == "additive":  # Hugging Face's extended padding mask
            attn_mask = torch.zeros(batch, 1, 1, seq, dtype=DTYPES[dtype])
        padding = torch.zeros(batch, seq, dtype=torch.bool) if key_padding else None
        out = attention(
            q,
            k,
            v,
            attn_mask,
            dropout,
            causal,
            enable_gqa=kv_heads != heads,
            key_padding_mask=padding,
            deterministic=deterministic,
            relative_bias=relative_bias,
            window=window,
        )
        return lambda: out.backward(torch.zeros_like(out))

    params = dict(
        head_dim=head_dim,
        dtype=dtype,
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        seq_q=seq,
        seq_k=seq,
        causal=causal,
        dropout=dropout,
        mask=mask,
        key_padding=key_padding,
        layout=layout,
        deterministic=deterministic,
        window=window,
    )
    return Case(name, "attention", run, params, ci)


def attention_cases() -> list[Case]:
    cases = []
    for head_dim in (40, 64, 72, 80, 96, 128, 256):
        for dtype in ("bf16", "fp16", "fp32"):
            cases.append(attention_case(head_dim, dtype, ci=(dtype, head_dim) in (("bf16", 72), ("fp32", 128))))
    for head_dim in (64, 128):
        cases += [
            attention_case(head_dim, causal=True),
            attention_case(head_dim, dropout=0.1),
            attention_case(head_dim, mask="bool"),
            attention_case(head_dim, mask="additive", ci=head_dim == 128),
            attention_case(head_dim, key_padding=True),
            attention_case(head_dim, heads=32, kv_heads=8),
            attention_case(head_dim, heads=32, kv_heads=8, dropout=0.1),
            attention_case(head_dim, heads=32, kv_heads=8, causal=True, dropout=0.1),
            attention_case(head_dim, seq=500),
            attention_case(head_dim, layout="bhsd"),
            attention_case(head_dim, dtype="fp16", causal=True, dropout=0.1),
            attention_case(head_dim, causal=True, dropout=0.1, key_padding=True, ci=head_dim == 64),
        ]
    for head_dim in (72, 80, 96, 256):
        cases.append(attention_case(head_dim, dropout=0.1))
    # every mask with dropout (sf.attention, like SDPA, takes no attn_mask beside is_causal)
    for head_dim in (64, 72, 128, 256):
        cases.append(attention_case(head_dim, dropout=0.1, mask="bool", key_padding=True, ci=head_dim == 256))
    cases.append(attention_case(72, layout="bhsd"))
    # a relative bias (MPNet: d64, dropout, padding), read along the diagonals, its
    # gradient added with atomics in the dK/dV kernel
    cases.append(attention_case(64, dropout=0.1, mask="relative", key_padding=True, ci=True))
    cases.append(attention_case(64, mask="relative", deterministic=False))
    # a sliding window (ModernBERT's local layers: 64 either side), every visited tile an edge tile
    cases.append(attention_case(64, dropout=0.1, key_padding=True, window=64, ci=True))
    cases.append(attention_case(64, window=64, deterministic=False))
    # the backward's one-pass dQ (deterministic=False)
    for head_dim in (64, 128, 256):
        cases.append(attention_case(head_dim, deterministic=False, ci=head_dim == 128))
    for head_dim in (64, 128):
        cases += [
            attention_case(head_dim, causal=True, deterministic=False),
            attention_case(head_dim, dropout=0.1, deterministic=False),
            attention_case(head_dim, mask="additive", deterministic=False),
            attention_case(head_dim, heads=32, kv_heads=8, deterministic=False),
        ]
    cases.append(attention_case(64, "fp32", deterministic=False))
    return cases


def varlen_attention_case(head_dim, dtype="bf16", *, seq=512, batch=16, causal=False, dropout=0.0, ci=False) -> Case:
    """``varlen_attention`` over ``batch`` packed sequences of ``seq`` tokens each: the
    dense cases' work, so the figures compare with theirs."""
    from slimformer.kernels.varlen_attention import varlen_attention

    heads = max(1, 768 // head_dim)
    flags = [f"d{head_dim}", dtype, f"s{seq}", "varlen", "causal" if causal else "",
             f"dropout{dropout:g}" if dropout else ""]  # fmt: skip
    name = "attn " + " ".join(f for f in flags if f)

    def run():
        cu_seqlens = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32)
        qkv = torch.zeros(batch * seq, 3 * heads, head_dim, dtype=DTYPES[dtype], requires_grad=True)
        q, k, v = qkv.split(heads, dim=1)
        out = varlen_attention(q, k, v, cu_seqlens, cu_seqlens, seq, seq, dropout, causal)
        return lambda: out.backward(torch.zeros_like(out))

    params = dict(
        head_dim=head_dim,
        dtype=dtype,
        batch=batch,
        heads=heads,
        kv_heads=heads,
        seq_q=seq,
        seq_k=seq,
        causal=causal,
        dropout=dropout,
        mask=None,
        key_padding=False,
        layout="varlen",
    )
    return Case(name, "attention", run, params, ci)


def varlen_attention_cases() -> list[Case]:
    cases = [varlen_attention_case(head_dim) for head_dim in (64, 72, 128, 256)]
    cases.append(varlen_attention_case(64, causal=True, dropout=0.1, ci=True))
    cases.append(varlen_attention_case(128, causal=True))
    cases.append(varlen_attention_case(128, "fp16", causal=True))
    cases.append(varlen_attention_case(128, dropout=0.1))
    cases.append(varlen_attention_case(256, causal=True, dropout=0.1))
    return cases


def disentangled_attention_case(
    dtype="bf16",
    *,
    head_dim=64,
    heads=12,
    seq=512,
    batch=8,
    dropout=0.0,
    padding=True,
    position_buckets=256,
    max_relative_positions=512,
    ci=False,
) -> Case:
    """DeBERTa(-v2/-v3)'s disentangled attention (``disentangled_attention``) with both position
    terms (c2p and p2c), called as slimformer's fused DeBERTa layer calls it
    (``slimformer.integrations.hf.deberta``): q, k, v head views of three (batch, seq, hidden)
    projections, the position keys and queries (heads, 2 · span, head_dim) head views of a
    (2 · span, hidden) projection of the relative embeddings, and the batch's padding as both
    the key and the query padding mask. Named without "attn", so ``-k attn`` keeps selecting
    plain attention; the estimates count plain attention's GEMMs, so the position GEMMs show
    in FLOPs ×min."""
    from slimformer.kernels.attention.disentangled import disentangled_attention

    span_rows = 2 * position_buckets if position_buckets > 0 else 2 * max_relative_positions
    flags = [
        f"d{head_dim}", dtype, f"s{seq}", f"h{heads}", "bshd", "c2p+p2c", f"dropout{dropout:g}" if dropout else "",
        "key-padding query-padding" if padding else "",
    ]  # fmt: skip
    name = "disentangled " + " ".join(f for f in flags if f)

    def run():
        torch_dtype = DTYPES[dtype]
        q, k, v = _attention_inputs(batch, heads, heads, seq, seq, head_dim, torch_dtype, "bshd")
        pos_key, pos_query = (
            rearrange(
                torch.zeros(span_rows, heads * head_dim, dtype=torch_dtype, requires_grad=True),
                "p (h d) -> h p d",
                h=heads,
            )
            for _ in range(2)
        )
        mask = torch.zeros(batch, seq, dtype=torch.bool) if padding else None
        out = disentangled_attention(
            q,
            k,
            v,
            pos_key,
            pos_query,
            position_buckets=position_buckets,
            max_relative_positions=max_relative_positions,
            key_padding_mask=mask,
            query_padding_mask=mask,
            dropout_p=dropout,
        )
        return lambda: out.backward(torch.zeros_like(out))

    params = dict(
        head_dim=head_dim,
        dtype=dtype,
        batch=batch,
        heads=heads,
        kv_heads=heads,
        seq_q=seq,
        seq_k=seq,
        causal=False,
        dropout=dropout,
        mask=None,
        key_padding=padding,
        query_padding=padding,
        layout="bshd",
        deterministic=True,
        window=None,
        terms="c2p+p2c",
        position_rows=span_rows,
        position_buckets=position_buckets,
        max_relative_positions=max_relative_positions,
    )
    return Case(name, "attention", run, params, ci)


def varlen_disentangled_attention_case(dtype="bf16", *, heads=12, head_dim=64, batch=8, seq=512, dropout=0.1) -> Case:
    """``varlen_disentangled_attention`` as the unpadded DeBERTa layer calls it: q, k, v head
    views of three packed (total, hidden) projections, half the tokens real (lengths spread
    over (0, seq]), 256 position buckets."""
    from slimformer.kernels.attention.disentangled import varlen_disentangled_attention

    name = f"disentangled varlen d{head_dim} {dtype} s{seq} h{heads} c2p+p2c" + (
        f" dropout{dropout:g}" if dropout else ""
    )
    lengths = [max(1, round(seq * (i + 0.5) / batch)) for i in range(batch)]

    def run():
        torch_dtype = DTYPES[dtype]
        total = sum(lengths)
        q, k, v = (
            rearrange(
                torch.zeros(total, heads * head_dim, dtype=torch_dtype, requires_grad=True), "t (h d) -> t h d", h=heads
            )
            for _ in range(3)
        )
        pos_key, pos_query = (
            rearrange(
                torch.zeros(512, heads * head_dim, dtype=torch_dtype, requires_grad=True), "p (h d) -> h p d", h=heads
            )
            for _ in range(2)
        )
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        out = varlen_disentangled_attention(
            q, k, v, cu, seq, pos_key, pos_query, position_buckets=256, max_relative_positions=512, dropout_p=dropout
        )
        return lambda: out.backward(torch.zeros_like(out))

    params = dict(
        head_dim=head_dim, dtype=dtype, batch=batch, heads=heads, kv_heads=heads, seq_q=seq, seq_k=seq, causal=False,
        dropout=dropout, mask=None, key_padding=False, layout="varlen", deterministic=True, window=None,
        terms="c2p+p2c", position_rows=512, position_buckets=256, max_relative_positions=512, real_tokens=sum(lengths),
    )  # fmt: skip
    return Case(name, "attention", run, params)


def disentangled_attention_cases() -> list[Case]:
    """DeBERTa-v3-base (12 heads of 64, 256 position buckets, 512 relative positions) at
    batch 8 × 512 tokens, bf16 and fp16 with and without dropout; fp32; and -large's 16
    heads. The CI compiles bf16 with dropout (the most per-element state) for sm_90."""
    cases = []
    for dtype in ("bf16", "fp16"):
        for dropout in (0.0, 0.1):
            cases.append(disentangled_attention_case(dtype, dropout=dropout, ci=(dtype, dropout) == ("bf16", 0.1)))
    cases.append(disentangled_attention_case("fp32"))
    cases.append(disentangled_attention_case("bf16", heads=16, dropout=0.1))
    cases.append(varlen_disentangled_attention_case())
    return cases


# ----------------------------------------------------------------------------- norms


def norm_case(
    n_cols,
    dtype="bf16",
    *,
    kind="layer",
    residual=False,
    dropout=0.0,
    memory_efficient=False,
    return_residual=False,
    rows=None,
    ci=False,
    dropout_after=False,
) -> Case:
    """``dropout_after``: dropout(LayerNorm(x)), the embeddings' norm of a patched BERT."""
    from slimformer.kernels.norm import fused_norm, layer_norm, rms_norm

    rows = rows or max(64, min(4096, 2**22 // n_cols))
    flags = [
        f"{kind}-norm", f"N{n_cols}", dtype, "+residual" if residual else "",
        f"+dropout{dropout:g}{' after' if dropout_after else ''}" if dropout else "",
        "memory-efficient" if memory_efficient else "",
        "return-residual" if return_residual else "",
    ]  # fmt: skip
    name = " ".join(f for f in flags if f) + f" ({rows} rows)"

    def run():
        torch_dtype = DTYPES[dtype]
        x = torch.zeros(rows, n_cols, dtype=torch_dtype, requires_grad=True)
        r = torch.zeros(rows, n_cols, dtype=torch_dtype, requires_grad=True) if residual else None
        w = torch.ones(n_cols, dtype=torch_dtype, requires_grad=True)
        options = dict(
            residual=r, dropout_p=dropout, memory_efficient=memory_efficient, return_residual=return_residual
        )
        if dropout_after:
            b = torch.zeros(n_cols, dtype=torch_dtype, requires_grad=True)
            out = fused_norm(x, n_cols, w, b, 1e-5, is_rms=kind == "rms", dropout_after=True, **options)
        elif kind == "layer":
            b = torch.zeros(n_cols, dtype=torch_dtype, requires_grad=True)
            out = layer_norm(x, n_cols, w, b, **options)
        else:
            out = rms_norm(x, n_cols, w, **options)
        outs = out if isinstance(out, tuple) else (out,)
        return lambda: torch.autograd.backward(outs, [torch.zeros_like(o) for o in outs])

    params = dict(
        rows=rows,
        n_cols=n_cols,
        dtype=dtype,
        elements=rows * n_cols,
        kind=kind,
        residual=residual,
        dropout=dropout,
        memory_efficient=memory_efficient,
        return_residual=return_residual,
    )
    return Case(name, "norm", run, params, ci)


def norm_cases() -> list[Case]:
    cases = []
    for n_cols in (768, 1024, 2048, 4096, 8192, 16384, 65536):
        cases += [
            norm_case(n_cols),
            norm_case(n_cols, residual=True, dropout=0.1, ci=n_cols in (768, 8192)),
            norm_case(n_cols, residual=True, dropout=0.1, memory_efficient=True),
            norm_case(n_cols, kind="rms", residual=True, return_residual=True),
        ]
    for dtype in ("fp16", "fp32"):
        for n_cols in (768, 4096):
            cases.append(norm_case(n_cols, dtype, residual=True, dropout=0.1))
    cases.append(norm_case(1000, residual=True, dropout=0.1))
    cases.append(norm_case(4096, rows=2048))  # issue 9's LayerNorm-backward shape
    cases.append(norm_case(65536, rows=16384))  # one row per program: the widest rows at scale
    cases += [norm_case(n_cols, dropout=0.1, dropout_after=True) for n_cols in (768, 16384)]  # embeddings
    return cases


# ----------------------------------------------------------------------------- dropout, activations


def dropout_case(dtype="bf16", *, rows=4096, n_cols=768, ci=False) -> Case:
    from slimformer.kernels.dropout import dropout_add

    def run():
        x = torch.zeros(rows, n_cols, dtype=DTYPES[dtype], requires_grad=True)
        r = torch.zeros(rows, n_cols, dtype=DTYPES[dtype], requires_grad=True)
        out = dropout_add(x, r, 0.1)
        return lambda: out.backward(torch.zeros_like(out))

    params = dict(rows=rows, n_cols=n_cols, dtype=dtype, elements=rows * n_cols)
    return Case(f"dropout_add {rows}x{n_cols} {dtype}", "dropout", run, params, ci)


def activation_case(activation, dtype="bf16", *, dropout=0.1, rows=512, d_model=768, hidden=3072, ci=False) -> Case:
    from slimformer.kernels.activation import fused_mlp

    def run():
        torch_dtype = DTYPES[dtype]
        x = torch.zeros(rows, d_model, dtype=torch_dtype, requires_grad=True)
        w1 = torch.zeros(hidden * (2 if activation == "swiglu" else 1), d_model, dtype=torch_dtype, requires_grad=True)
        w2 = torch.zeros(d_model, hidden, dtype=torch_dtype, requires_grad=True)
        out = fused_mlp(x, w1, None, w2, None, activation, dropout)
        return lambda: out.backward(torch.zeros_like(out))

    name = f"mlp {activation} {rows}x{hidden} {dtype}" + (f" +dropout{dropout:g}" if dropout else "")
    params = dict(rows=rows, n_cols=hidden, dtype=dtype, elements=rows * hidden, activation=activation, dropout=dropout)
    return Case(name, "activation", run, params, ci)


def elementwise_cases() -> list[Case]:
    cases = [dropout_case(dtype, ci=dtype == "bf16") for dtype in ("bf16", "fp16", "fp32")]
    for activation in ("relu", "gelu", "gelu_tanh", "swiglu"):
        cases.append(activation_case(activation, ci=activation in ("gelu", "swiglu")))
        cases.append(activation_case(activation, dropout=0.0))
    cases.append(activation_case("gelu", "fp32"))
    cases.append(activation_case("gelu", "fp16"))
    return cases


def loss_case(dtype="bf16", *, rows=300, hidden=768, vocab=30522, ci=False) -> Case:
    """The masked-LM head's linear + cross-entropy: the labelled rows of a batch of 4 x 512."""
    from slimformer.kernels.linear_cross_entropy import linear_cross_entropy

    def run():
        torch_dtype = DTYPES[dtype]
        x = torch.zeros(rows, hidden, dtype=torch_dtype, requires_grad=True)
        w = torch.zeros(vocab, hidden, dtype=torch_dtype, requires_grad=True)
        loss = linear_cross_entropy(x, w, None, torch.zeros(rows, dtype=torch.long))
        return loss.backward

    params = dict(rows=rows, n_cols=vocab, dtype=dtype, elements=rows * vocab)
    return Case(f"linear+cross-entropy {rows}x{hidden}->{vocab} {dtype}", "loss", run, params, ci)


def loss_cases() -> list[Case]:
    return [loss_case(dtype, ci=dtype == "bf16") for dtype in ("bf16", "fp16", "fp32")]


# ----------------------------------------------------------------------------- GEMMs


def gemm_case(kind, dtype="bf16", *, rows=256, in_features=768, out_features=3072, ci=False) -> Case:
    """rows=256 keeps every autotune config (pruning drops short tiles from 1024 rows on)."""
    from slimformer.kernels import matmul

    def run():
        torch_dtype = DTYPES[dtype]
        x = torch.zeros(rows, in_features, dtype=torch_dtype)
        w = torch.zeros(out_features, in_features, dtype=torch_dtype)
        bias = torch.zeros(out_features, dtype=torch_dtype)
        if kind == "float":
            matmul.linear(x, w, bias, activation="gelu")
            return None
        q_weight, scale = matmul.quantize_per_channel(w)
        if kind == "w8a8":
            matmul.int8_linear(x, q_weight, scale, bias, activation="gelu", smooth=torch.ones(in_features))
        else:
            matmul.int8_weight_only_linear(x, q_weight, scale, bias, activation="gelu")
        return None  # inference only

    name = f"gemm {kind} {rows}x{in_features}->{out_features} {dtype}"
    params = dict(
        kind=kind,
        dtype=dtype,
        rows=rows,
        in_features=in_features,
        out_features=out_features,
        flops=2 * rows * in_features * out_features,
    )
    return Case(name, "gemm", run, params, ci)


def gemm_cases() -> list[Case]:
    cases = []
    for kind in ("float", "w8a8", "w8a16"):
        for dtype in ("bf16", "fp16"):
            cases.append(gemm_case(kind, dtype))
        cases.append(gemm_case(kind, "bf16", rows=4096, ci=True))  # the tall-tile configs only
    cases.append(gemm_case("float", "fp32"))
    cases.append(gemm_case("float", "bf16", rows=250, in_features=770, out_features=1000))
    return cases


def all_cases() -> list[Case]:
    attention = attention_cases() + varlen_attention_cases() + disentangled_attention_cases()
    return attention + norm_cases() + elementwise_cases() + loss_cases() + gemm_cases()


def allowed_pairs(seq_q: int, seq_k: int, causal: bool) -> int:
    """(query, key) pairs a query may attend (causal: top-left aligned, as SDPA)."""
    if not causal:
        return seq_q * seq_k
    return sum(min(seq_k, i + 1) for i in range(seq_q))


def allowed_tiles(seq_q: int, seq_k: int, block_q: int, block_k: int, causal: bool) -> int:
    """(block_q × block_k) tiles of one head's score matrix with at least one allowed pair."""
    tiles_q, tiles_k = math.ceil(seq_q / block_q), math.ceil(seq_k / block_k)
    if not causal:
        return tiles_q * tiles_k
    return sum(min(tiles_k, math.ceil(min(seq_k, (i + 1) * block_q) / block_k)) for i in range(tiles_q))
