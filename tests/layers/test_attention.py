"""slimformer's attention layers vs torch.nn.MultiheadAttention with the same weights.

The exact result is torch's module in float64; errors are bounded by twice torch's own
error in the tested dtype (``assert_within_reference_error``).
"""

import math
import re

import pytest
import torch
from torch import nn

import slimformer as sf
from slimformer.layers.attention import MultiheadAttention, SelfAttention
from slimformer.memory import measure_activation_memory
from tests.helpers import assert_within_reference_error

DTYPES = [
    pytest.param(torch.float32, 8.0, id="fp32"),
    pytest.param(torch.float16, 1.0, id="fp16"),
    pytest.param(torch.bfloat16, 1.0, id="bf16"),
]


def _modules(dtype, **kwargs):
    """(slimformer layer in dtype, torch module in dtype, torch module in float64), same weights."""
    torch.manual_seed(0)
    exact = nn.MultiheadAttention(**kwargs, dtype=torch.float64)
    same_dtype = nn.MultiheadAttention(**kwargs, dtype=dtype)
    ours = MultiheadAttention(**kwargs, dtype=dtype)
    for module in (same_dtype, ours):
        module.load_state_dict(exact.state_dict())
    return ours, same_dtype, exact


def _run(module, query, key, value, grad, self_attention, **kwargs):
    """Output, input gradients and parameter gradients of one forward and backward."""
    module.zero_grad()
    query = query.detach().clone().requires_grad_()
    key, value = (query, query) if self_attention else (x.detach().clone().requires_grad_() for x in (key, value))
    out, _ = module(query, key, value, need_weights=False, **kwargs)
    out.backward(grad)
    inputs = {"query": query} if self_attention else {"query": query, "key": key, "value": value}
    grads = {f"d{name}": tensor.grad for name, tensor in inputs.items()}
    grads.update({f"d{name}": parameter.grad for name, parameter in module.named_parameters()})
    return {"out": out.detach(), **grads}


def _check(dtype, ulps, module_kwargs, shapes, self_attention, mask_fn=lambda dtype: {}):
    ours, same_dtype, exact = _modules(dtype, **module_kwargs)
    gen = torch.Generator().manual_seed(1)
    query, key, value, grad = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in shapes)
    results = [
        _run(module, *(x.to(module_dtype) for x in (query, key, value, grad)), self_attention, **mask_fn(module_dtype))
        for module, module_dtype in ((ours, dtype), (same_dtype, dtype), (exact, torch.float64))
    ]
    for name in results[2]:
        assert_within_reference_error(name, *(result[name] for result in results), ulps)


def _padding(batch, seq, device="cpu"):
    """Bool padding mask, True = padding: batch b pads its last b keys (no row fully padded)."""
    return torch.arange(seq, device=device)[None, :] >= seq - torch.arange(batch, device=device)[:, None]


@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_self_attention_batch_first_with_padding(backend, dtype, ulps):
    _check(
        dtype,
        ulps,
        dict(embed_dim=64, num_heads=4, batch_first=True),
        [(3, 37, 64)] * 4,
        True,
        lambda _: {"key_padding_mask": _padding(3, 37)},
    )


@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_self_attention_sequence_first_with_bool_mask(backend, dtype, ulps):
    gen = torch.Generator().manual_seed(2)
    blocked = torch.rand(29, 29, generator=gen) > 0.7
    blocked.fill_diagonal_(False)
    _check(
        dtype,
        ulps,
        dict(embed_dim=80, num_heads=2),
        [(29, 2, 80)] * 4,
        True,
        lambda _: {"attn_mask": blocked},
    )


@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_causal_hint(backend, dtype, ulps):
    causal = torch.ones(33, 33, dtype=torch.bool).triu(1)
    _check(
        dtype,
        ulps,
        dict(embed_dim=48, num_heads=3, batch_first=True),
        [(2, 33, 48)] * 4,
        True,
        lambda _: {"attn_mask": causal, "is_causal": True, "key_padding_mask": _padding(2, 33)},
    )


@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_cross_attention_with_kdim_vdim_and_float_masks(backend, dtype, ulps):
    gen = torch.Generator().manual_seed(3)
    additive = torch.randn(2 * 3, 17, 33, generator=gen)
    padding = torch.zeros(2, 33).masked_fill(_padding(2, 33), -math.inf)
    _check(
        dtype,
        ulps,
        dict(embed_dim=48, num_heads=3, kdim=32, vdim=24, batch_first=True),
        [(2, 17, 48), (2, 33, 32), (2, 33, 24), (2, 17, 48)],
        False,
        lambda dtype: {"attn_mask": additive.to(dtype), "key_padding_mask": padding.to(dtype)},
    )


def test_float64_matches_torch_and_passes_gradcheck(backend):
    # the fused path (need_weights=False) in float64: the PyTorch reference in float64, on every device
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    layer = MultiheadAttention.from_torch(reference)
    x, kv = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 7, 8, dtype=torch.float64)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    for key, kwargs in (
        (x, {"key_padding_mask": _padding(2, 5)}),
        (x, {"attn_mask": causal, "is_causal": True}),
        (kv, {"key_padding_mask": _padding(2, 7)}),
    ):
        out = layer(x, key, key, need_weights=False, **kwargs)[0]
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, reference(x, key, key, need_weights=False, **kwargs)[0], rtol=1e-12, atol=1e-12)
    x.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: layer(x, x, x, need_weights=False, key_padding_mask=_padding(2, 5))[0], (x,), fast_mode=True
    )


@pytest.mark.parametrize("padding", ["none", "bool", "float"])
def test_causal_hint_is_read_as_torch_reads_it(backend, padding):
    # is_causal=True with an attn_mask: torch applies the causal mask without reading attn_mask,
    # unless a key_padding_mask comes too: then attn_mask, merged with it, is applied as given.
    # The attn_mask here is not causal, so each reading gives another result.
    ours, same_dtype, _ = _modules(torch.float32, embed_dim=16, num_heads=2, batch_first=True)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 16, generator=gen)
    not_causal = torch.rand(6, 6, generator=gen) > 0.6
    not_causal.fill_diagonal_(False)
    key_padding_mask = {"none": None, "bool": _padding(2, 6)}.get(padding)
    if padding == "float":  # torch wants both masks of one type
        key_padding_mask = torch.zeros(2, 6).masked_fill(_padding(2, 6), -math.inf)
        not_causal = torch.zeros(6, 6).masked_fill(not_causal, -math.inf)
    kwargs = dict(key_padding_mask=key_padding_mask, attn_mask=not_causal, is_causal=True, need_weights=False)
    torch.testing.assert_close(ours(x, x, x, **kwargs)[0], same_dtype(x, x, x, **kwargs)[0], rtol=1e-5, atol=1e-5)


def test_causal_hint_without_attn_mask_applies_the_causal_mask(backend):
    # torch asks for the mask the hint describes; slimformer applies the causal mask itself,
    # with any key_padding_mask (an additive one goes in as a mask holding both)
    ours, same_dtype, _ = _modules(torch.float32, embed_dim=16, num_heads=2, batch_first=True)
    x = torch.randn(2, 6, 16)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    float_padding = torch.zeros(2, 6).masked_fill(_padding(2, 6), -math.inf)
    float_causal = nn.Transformer.generate_square_subsequent_mask(6)
    for key_padding_mask, attn_mask in ((None, causal), (_padding(2, 6), causal), (float_padding, float_causal)):
        out = ours(x, x, x, key_padding_mask=key_padding_mask, is_causal=True, need_weights=False)[0]
        expected = same_dtype(x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False)[0]
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_unbatched_input(backend):
    _check(torch.float32, 8.0, dict(embed_dim=32, num_heads=2), [(19, 32)] * 4, True)


def test_need_weights_returns_torchs_weights(backend):
    ours, same_dtype, _ = _modules(torch.float32, embed_dim=32, num_heads=4, batch_first=True)
    x = torch.randn(2, 11, 32)
    for average in (True, False):
        kwargs = dict(key_padding_mask=_padding(2, 11), average_attn_weights=average)
        (out, weights), (expected_out, expected_weights) = ours(x, x, x, **kwargs), same_dtype(x, x, x, **kwargs)
        assert torch.equal(weights, expected_weights) and torch.equal(out, expected_out)


def test_drop_in_for_torch_module():
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(32, 4, kdim=16, vdim=8)
    ours = MultiheadAttention(32, 4, kdim=16, vdim=8)
    assert isinstance(ours, nn.MultiheadAttention)
    assert ours.state_dict().keys() == reference.state_dict().keys()
    ours.load_state_dict(reference.state_dict())
    shared = MultiheadAttention.from_torch(reference, recompute_qkv=True)
    assert all(a is b for a, b in zip(shared.parameters(), reference.parameters()))
    assert shared.recompute_qkv and not ours.recompute_qkv
    query, key, value = torch.randn(7, 2, 32), torch.randn(9, 2, 16), torch.randn(9, 2, 8)
    expected = reference(query, key, value, need_weights=False)[0]
    for layer in (ours, shared):
        torch.testing.assert_close(layer(query, key, value, need_weights=False)[0], expected)


def test_dropout_applies_in_training_only(backend):
    layer = MultiheadAttention(32, 2, dropout=0.5, batch_first=True)
    x = torch.randn(2, 24, 32)

    def run(seed):
        torch.manual_seed(seed)
        return layer(x, x, x, need_weights=False)[0]

    assert torch.equal(run(0), run(0)) and not torch.equal(run(0), run(1))
    layer.eval()
    assert torch.equal(run(0), run(1))


def test_recompute_qkv_changes_memory_not_results(backend):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, 32, generator=gen)
    padding = _padding(2, 24)
    results = []
    for recompute in (False, True):
        torch.manual_seed(5)
        layer = MultiheadAttention(32, 2, dropout=0.2, batch_first=True, recompute_qkv=recompute)
        results.append(_run(layer, x, x, x, torch.ones(2, 24, 32), True, key_padding_mask=padding))
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recompute_qkv", [False, True])
def test_self_attention_under_autocast_like_torch(backend, recompute_qkv):
    # fp32 weights, bf16 input: the projection runs in bf16 as torch's does
    ours, torch_module, _ = _modules(torch.float32, embed_dim=32, num_heads=2, batch_first=True)
    ours.recompute_qkv = recompute_qkv
    x = torch.randn(2, 17, 32).to(torch.bfloat16)
    results = []
    for module in (ours, torch_module):
        module.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = module(x, x, x, key_padding_mask=_padding(2, 17), need_weights=False)
        out.float().sum().backward()
        results.append((out, module.in_proj_weight.grad))
    (out, dweight), (out_ref, dweight_ref) = results
    assert out.dtype == out_ref.dtype == torch.bfloat16 and dweight.dtype == torch.float32
    # bf16 projections, softmax and output: a few bf16 ulps (2^-8) of values ~1
    torch.testing.assert_close(out, out_ref, rtol=0.03, atol=0.03)
    torch.testing.assert_close(dweight, dweight_ref, rtol=0.05, atol=0.05 * dweight_ref.abs().max().item())


def _self_attention_inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 50, 64, generator=gen).to(dtype).requires_grad_(), _padding(2, 50)


@pytest.mark.parametrize("dtype, ulps", DTYPES)
def test_fused_qkv_layer_matches_torch(backend, dtype, ulps):
    torch.manual_seed(0)
    ours = SelfAttention(64, 4, recompute_qkv=True, dtype=dtype)
    exact = nn.MultiheadAttention(64, 4, batch_first=True, dtype=torch.float64)
    same_dtype = nn.MultiheadAttention(64, 4, batch_first=True, dtype=dtype)
    weights = {
        "in_proj_weight": ours.qkv_proj.weight, "in_proj_bias": ours.qkv_proj.bias,
        "out_proj.weight": ours.out_proj.weight, "out_proj.bias": ours.out_proj.bias,
    }  # fmt: skip
    for module in (exact, same_dtype):
        module.load_state_dict(weights)
    x, padding = _self_attention_inputs(torch.float64)
    causal = torch.ones(50, 50, dtype=torch.bool).triu(1)
    grad = torch.randn_like(x)
    outputs = []
    for module, module_dtype in ((ours, dtype), (same_dtype, dtype), (exact, torch.float64)):
        xi = x.detach().to(module_dtype).requires_grad_()
        if module is ours:
            out = module(xi, key_padding_mask=padding, is_causal=True)
        else:
            out = module(xi, xi, xi, key_padding_mask=padding, attn_mask=causal, need_weights=False)[0]
        out.backward(grad.to(module_dtype))
        qkv_weight_grad = ours.qkv_proj.weight.grad if module is ours else module.in_proj_weight.grad
        outputs.append((out.detach(), xi.grad, qkv_weight_grad))
    for name, *tensors in zip(("out", "dx", "dqkv_weight"), *outputs):
        assert_within_reference_error(name, *tensors, ulps)


@pytest.mark.parametrize("recompute_qkv", [False, True], ids=["keep-qkv", "recompute-qkv"])
def test_fused_qkv_layer_keeps_only_output_and_lse(backend, recompute_qkv):
    layer = SelfAttention(64, 4, dropout=0.1, recompute_qkv=recompute_qkv)
    x, padding = _self_attention_inputs(torch.float32)
    memory = measure_activation_memory(layer, x, key_padding_mask=padding)
    out_bytes, lse_bytes, seed_bytes = 2 * 50 * 64 * 4, 2 * 4 * 50 * 4, 8
    qkv_bytes = 0 if recompute_qkv else 3 * out_bytes
    assert memory.saved_bytes == qkv_bytes + out_bytes + lse_bytes + seed_bytes, memory.saved
    assert memory.alive_bytes == memory.saved_bytes, memory.alive


def test_multihead_attention_memory_grows_linearly(backend):
    def kept(seq):
        layer = MultiheadAttention(64, 1, batch_first=True, dtype=torch.float16)
        x = torch.randn(1, seq, 64, dtype=torch.float16, requires_grad=True)
        memory = measure_activation_memory(
            lambda x: layer(x, x, x, need_weights=False)[0], x, exclude=layer.parameters()
        )
        assert not any(r.shape[-2:] == (seq, seq) for r in memory.saved + memory.alive)
        return max(memory.saved_bytes, memory.alive_bytes)

    assert kept(512) / kept(128) <= 4.2


def test_bad_masks_raise():
    layer = MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(N \* num_heads, L, S\) = \(8, 5, 5\)"):
        layer(x, x, x, attn_mask=torch.zeros(3, 5, 5), need_weights=False)
    with pytest.raises(TypeError, match="key_padding_mask must be bool or floating point"):
        layer(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.int64), need_weights=False)
    with pytest.raises(ValueError, match="num_heads must divide embed_dim 32, got 3"):
        SelfAttention(32, 3)


def _tiny_bert(transformers):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertModel(config, add_pooling_layer=False)


def test_transformers_bert_uses_kernel_with_padding_mask(backend):
    transformers = pytest.importorskip("transformers", minversion="5")
    from slimformer.layers.attention import register_transformers_attention

    name = register_transformers_attention()
    model = _tiny_bert(transformers)
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 100, (2, 24), generator=gen)
    attention_mask = torch.ones(2, 24, dtype=torch.long)
    attention_mask[1, 15:] = 0
    results = {}
    for implementation in ("eager", name):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        out = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        out.backward(torch.ones_like(out))
        results[implementation] = (out.detach(), model.encoder.layer[0].attention.self.query.weight.grad.clone())
        memory = measure_activation_memory(
            lambda ids: model(input_ids=ids, attention_mask=attention_mask).last_hidden_state,
            input_ids,
            exclude=[attention_mask],
        )
        squares = [r for r in memory.saved if r.shape[-2:] == (24, 24)]
        assert bool(squares) == (implementation == "eager"), squares
    for actual, expected in zip(results[name], results["eager"]):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def _tiny_llama(model_class):
    """A one-layer GQA Llama (4 query heads over 2 key/value heads) in eval mode, token ids
    (2, 9) and an all-ones attention mask."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    input_ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    return model_class(config).eval(), input_ids, torch.ones(2, 9, dtype=torch.long)


def test_transformers_decoder_with_cache_and_gqa(backend):
    transformers = pytest.importorskip("transformers", minversion="5")
    from slimformer.layers.attention import register_transformers_attention

    name = register_transformers_attention()
    model, input_ids, attention_mask = _tiny_llama(transformers.LlamaForCausalLM)
    attention_mask[1, :3] = 0  # left padding, as for generation
    logits = {}
    for implementation in ("eager", name):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            prefill = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True)
            step = model(
                input_ids=input_ids[:, -1:],
                attention_mask=torch.cat([attention_mask, attention_mask[:, -1:]], 1),
                past_key_values=prefill.past_key_values,
                use_cache=True,
            )
        logits[implementation] = (prefill.logits[attention_mask.bool()], step.logits)
    for actual, expected in zip(logits[name], logits["eager"]):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_transformers_output_attentions_forms_eager_weights():
    # causal, GQA and left padding: the weights (and outputs) eager attention gives
    transformers = pytest.importorskip("transformers", minversion="5")
    from slimformer.layers.attention import register_transformers_attention

    name = register_transformers_attention()
    model, input_ids, attention_mask = _tiny_llama(transformers.LlamaModel)
    attention_mask[1, :3] = 0
    results = {}
    for implementation in ("eager", name):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=attention_mask, output_attentions=True)
        results[implementation] = (out.attentions[0], out.last_hidden_state[attention_mask.bool()])
    for actual, expected in zip(results[name], results["eager"]):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("argument", ["softcap", "s_aux"])
def test_transformers_arguments_the_kernel_lacks_raise(argument):
    transformers = pytest.importorskip("transformers", minversion="5")
    from slimformer.layers.attention import register_transformers_attention

    forward = transformers.AttentionInterface()[register_transformers_attention()]
    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(NotImplementedError, match=f"slimformer attention has no {argument}"):
        forward(nn.Module(), q, q, q, None, **{argument: torch.ones(2) if argument == "s_aux" else 30.0})
    assert forward(nn.Module(), q, q, q, None, softcap=None)[0].shape == (1, 5, 2, 16)


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((2, 5, 16), (2, 5, 16), (2, 5, 16)), "query must have 32 features in its last dim, got shape (2, 5, 16)"),
        (((2, 5, 32), (2, 6, 32), (2, 5, 32)), "key and value must have the same batch and sequence sizes"),
        (((2, 5, 32), (3, 5, 32), (3, 5, 32)), "key must have query's batch size 2, got shape (3, 5, 32)"),
        (((2, 5, 32), (5, 32), (5, 32)), "query, key and value must all be 3-d (batched) or all 2-d (unbatched)"),
        (((1, 2, 5, 32),) * 3, "query, key and value must all be 3-d"),
    ],
)
def test_fused_path_validates_shapes_like_torch(shapes, message):
    layer, reference = sf.MultiheadAttention(32, 4, batch_first=True), nn.MultiheadAttention(32, 4, batch_first=True)
    tensors = [torch.randn(shape) for shape in shapes]
    with pytest.raises((AssertionError, RuntimeError)):  # torch refuses the same misuse
        reference(*tensors, need_weights=False)
    with pytest.raises(ValueError, match=re.escape(message)):
        layer(*tensors, need_weights=False)


@pytest.mark.parametrize(
    "build",
    [
        lambda: sf.MultiheadAttention(16, 2),
        lambda: sf.SelfAttention(16, 2),
        lambda: sf.LayerNorm(16),
        lambda: sf.RMSNorm(16),
        lambda: sf.TransformerEncoderLayer(16, 2, 32),
        lambda: nn.Sequential(nn.Linear(16, 16), sf.LayerNorm(16)),
    ],
    ids=["MultiheadAttention", "SelfAttention", "LayerNorm", "RMSNorm", "TransformerEncoderLayer", "inside a model"],
)
def test_torch_jit_script_says_to_use_torch_compile(build):
    with pytest.raises(RuntimeError, match="is not scriptable with torch.jit.script.*use torch.compile"):
        torch.jit.script(build())


def test_deterministic_false_gives_the_default_layers_gradients(backend):
    # the layers hand ``deterministic`` to the kernels (atomic dQ); fp32 results agree closely
    torch.manual_seed(0)
    x = torch.randn(2, 37, 64)
    grads = []
    for deterministic in (True, False):
        torch.manual_seed(0)
        mha = MultiheadAttention(64, 4, batch_first=True, deterministic=deterministic)
        block = SelfAttention(64, 4, deterministic=deterministic)
        x_ = x.clone().requires_grad_()
        (mha(x_, x_, x_, need_weights=False)[0] + block(x_, is_causal=True)).sum().backward()
        grads.append(x_.grad)
        assert f"deterministic={deterministic}" in repr(mha) and f"deterministic={deterministic}" in repr(block)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)
