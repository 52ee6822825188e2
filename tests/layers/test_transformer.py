"""slimformer.TransformerEncoderLayer vs torch's, recompute policies, and memory targets."""

import re

import pytest
import torch
from torch import nn

import slimformer as sf
from slimformer.layers import transformer as transformer_module
from slimformer.memory import measure_activation_memory
from slimformer.recompute import POLICIES
from tests.helpers import BRANCH_COVERING_POLICIES

D_MODEL, NHEAD, D_FF = 32, 4, 64


def test_branch_covering_policies_leave_out_only_parts_of_qkv_mlp():
    left_out = set(POLICIES) - set(BRANCH_COVERING_POLICIES)
    assert all(set(policy.split("+")) < {"qkv", "mlp"} for policy in left_out), left_out


def _pair(norm_first=False, activation="relu", dropout=0.0, batch_first=True, recompute="none", **kwargs):
    torch.manual_seed(0)
    reference = nn.TransformerEncoderLayer(
        D_MODEL, NHEAD, D_FF, dropout, activation, batch_first=batch_first, norm_first=norm_first, **kwargs
    )
    with torch.no_grad():  # LayerNorm weights away from their initial 1/0
        for norm in (reference.norm1, reference.norm2):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    layer = sf.TransformerEncoderLayer(
        D_MODEL,
        NHEAD,
        D_FF,
        dropout,
        activation,
        batch_first=batch_first,
        norm_first=norm_first,
        recompute=recompute,
        **kwargs,
    )
    layer.load_state_dict(reference.state_dict())
    return reference, layer


def _outputs_and_grads(layer, x, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    out = layer(x, **kwargs)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad(out, [x, *params], dy)
    return out, grads


def _padding(batch, seq):
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    mask[0, seq - 3 :] = True
    return mask


@pytest.mark.parametrize("mask", ["none", "padding", "causal"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_matches_torch_layer(backend, train, norm_first, activation, mask):
    reference, layer = _pair(norm_first, activation)
    reference.train(train)
    layer.train(train)
    x = torch.randn(2, 13, D_MODEL)
    kwargs = {}
    if mask == "padding":
        kwargs["src_key_padding_mask"] = _padding(2, 13)
    if mask == "causal":
        kwargs = dict(src_mask=nn.Transformer.generate_square_subsequent_mask(13), is_causal=True)
    out_ref, grads_ref = _outputs_and_grads(reference, x, **kwargs)
    out, grads = _outputs_and_grads(layer, x, **kwargs)
    if mask == "padding":  # torch leaves padded query rows unspecified on some paths: compare the rest
        keep = ~kwargs["src_key_padding_mask"]
        out, out_ref = out[keep], out_ref[keep]
    torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-4)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-4)


def test_sequence_first_and_unbatched(backend):
    reference, layer = _pair(batch_first=False)
    x = torch.randn(9, 2, D_MODEL)
    torch.testing.assert_close(layer(x), reference(x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer(x[:, 0]), reference(x[:, 0]), rtol=1e-4, atol=1e-4)


def test_state_dict_and_isinstance():
    reference, layer = _pair()
    assert isinstance(layer, nn.TransformerEncoderLayer)
    assert list(layer.state_dict()) == list(reference.state_dict())


def test_inside_transformer_encoder(backend):
    reference, layer = _pair(activation="gelu")
    encoder_ref = nn.TransformerEncoder(reference, num_layers=2, enable_nested_tensor=False)
    encoder = nn.TransformerEncoder(layer, num_layers=2)
    x = torch.randn(2, 7, D_MODEL)
    padding = _padding(2, 7)
    for training in (True, False):
        encoder_ref.train(training)
        encoder.train(training)
        with torch.no_grad():
            out_ref = encoder_ref(x, src_key_padding_mask=padding)[~padding]
            torch.testing.assert_close(
                encoder(x, src_key_padding_mask=padding)[~padding], out_ref, rtol=1e-4, atol=1e-4
            )


@pytest.mark.parametrize("nhead", [3, 4])
def test_no_fastpath_with_hooks(backend, nhead):
    # torch's test_transformerencoderlayer_no_fastpath_with_hooks_nhead_{3,4} (test/test_transformers.py):
    # a forward hook on self_attn fires once under inference_mode, here with what torch's layer gives it
    torch.manual_seed(0)
    reference = nn.TransformerEncoderLayer(d_model=12, nhead=nhead, dim_feedforward=12, batch_first=True).eval()
    layer = sf.TransformerEncoderLayer(d_model=12, nhead=nhead, dim_feedforward=12, batch_first=True).eval()
    layer.load_state_dict(reference.state_dict())
    src = torch.rand(2, 4, 12)
    results = []
    for model in (reference, layer):
        cache = []
        handle = model.self_attn.register_forward_hook(lambda module, inputs, output: cache.append(output[0].detach()))
        with torch.inference_mode():
            out = model(src)
        handle.remove()
        results.append((cache, out))
    (expected_cache, expected), (cache, out) = results
    assert len(cache) == 1, f"Expected 1 output, got {len(cache)}"
    torch.testing.assert_close(cache[0], expected_cache[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _record_calls(model, calls):
    """Hooks recording, on every submodule torch's forward calls, each call's name, inputs,
    keyword arguments and output, and each backward call's output gradient."""
    handles = []
    for name in ("self_attn", "norm1", "norm2", "linear1", "linear2", "dropout", "dropout1", "dropout2", "activation"):
        module = getattr(model, name)

        def pre(module, args, kwargs, name=name):
            calls.append((f"pre {name}", args, kwargs))

        def post(module, args, kwargs, output, name=name):
            calls.append((name, output))

        def backward(module, grad_input, grad_output, name=name):
            calls.append((f"backward {name}", grad_output))

        handles += [
            module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True),
            module.register_full_backward_hook(backward),
        ]
    return handles


def _assert_same_calls(calls, expected):
    assert [c[0] for c in calls] == [c[0] for c in expected]
    for call, expected_call in zip(calls, expected):
        for got, want in zip(call[1:], expected_call[1:]):
            got, want = (
                t if isinstance(t, dict) else dict(enumerate(t if isinstance(t, tuple) else (t,))) for t in (got, want)
            )
            assert got.keys() == want.keys(), call[0]
            for key, value in got.items():
                if isinstance(value, torch.Tensor):
                    torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-5, msg=f"{call[0]} {key}")
                else:
                    assert value == want[key], (call[0], key)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_hooks_on_every_submodule_fire_as_in_torch(monkeypatch, norm_first):
    # Outside its inference fast path torch's layer calls these submodules as modules; their
    # pre-hooks, hooks and backward hooks see the same calls, arguments and gradients here.
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # which hooks fire does not depend on the kernels
    reference, layer = _pair(norm_first, nn.GELU())
    x = torch.randn(2, 5, D_MODEL)
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    recorded = []
    for model in (reference, layer):
        calls = []
        handles = _record_calls(model, calls)
        out, grads = _outputs_and_grads(model, x, src_mask=mask, src_key_padding_mask=_padding(2, 5))
        for handle in handles:
            handle.remove()
        recorded.append((calls, out, grads))
    (expected_calls, expected, expected_grads), (calls, out, grads) = recorded
    _assert_same_calls(calls, expected_calls)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    for g, g_ref in zip(grads, expected_grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-4)


def test_fused_path_without_hooks_and_after_they_are_removed(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _, layer = _pair()
    fused, fused_calls = transformer_module.self_attention, []

    def counting(*args, **kwargs):
        fused_calls.append(args)
        return fused(*args, **kwargs)

    monkeypatch.setattr(transformer_module, "self_attention", counting)
    x = torch.randn(2, 5, D_MODEL)
    layer(x)
    assert len(fused_calls) == 1
    seen = []
    handle = layer.linear2.register_forward_hook(lambda module, args, output: seen.append(output))
    layer(x)
    assert len(fused_calls) == 1 and len(seen) == 1  # torch's forward, where linear2 is called as a module
    handle.remove()
    layer(x)
    assert len(fused_calls) == 2


@pytest.mark.parametrize(
    "norm_first, policy", [(False, "qkv+mlp"), (True, "full")], ids=["post-LN-qkv+mlp", "pre-LN-full"]
)
def test_float64_matches_torch_and_passes_gradcheck(norm_first, policy):
    # float64 runs the PyTorch references in float64 (attention, norms, MLP, dropout) on every
    # device: here with kernels interpreted, the branch CUDA tensors take
    reference, layer = _pair(norm_first, "gelu", recompute=policy, dtype=torch.float64)
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    padding = _padding(2, 5)
    for kwargs in ({"src_key_padding_mask": padding}, {"src_mask": nn.Transformer.generate_square_subsequent_mask(5)}):
        out, grads = _outputs_and_grads(layer, x, **kwargs)
        expected, expected_grads = _outputs_and_grads(reference, x, **kwargs)
        assert out.dtype == torch.float64
        keep = ~padding if "src_key_padding_mask" in kwargs else slice(None)  # padded rows: unspecified in torch
        torch.testing.assert_close(out[keep], expected[keep], rtol=1e-10, atol=1e-10)
        for g, g_ref in zip(grads, expected_grads):
            torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)
    small = sf.TransformerEncoderLayer(
        8, 2, 12, dropout=0.1, batch_first=True, norm_first=norm_first, dtype=torch.float64, recompute=policy
    ).train()

    def run(x):
        torch.manual_seed(0)  # the same dropout masks in every evaluation
        return small(x, src_key_padding_mask=padding[:, :3])

    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(run, (x,), fast_mode=True)


@pytest.mark.parametrize(
    "replaced",
    [("MultiheadAttention",), ("MultiheadAttention", "TransformerEncoderLayer", "LayerNorm", "RMSNorm")],
    ids=["MultiheadAttention", "all"],
)
def test_global_drop_in_of_torchs_classes(monkeypatch, replaced):
    # The pattern ``torch.nn.MultiheadAttention = slimformer.MultiheadAttention`` (monkeypatch puts
    # torch's classes back): construction, from_torch and forward still work.
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the classes matter here, not the kernels
    reference, _ = _pair()
    for name in replaced:
        monkeypatch.setattr(torch.nn, name, getattr(sf, name))
    built = sf.TransformerEncoderLayer(D_MODEL, NHEAD, D_FF, 0.0, batch_first=True)
    via_nn = nn.TransformerEncoderLayer(D_MODEL, NHEAD, D_FF, 0.0, batch_first=True)
    for layer in (built, via_nn):
        layer.load_state_dict(reference.state_dict())
    converted = [sf.TransformerEncoderLayer.from_torch(module) for module in (reference, via_nn, built)]
    x = torch.randn(2, 3, D_MODEL)
    expected = reference(x)
    for layer in (built, via_nn, *converted):
        torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)
    assert all(isinstance(layer.self_attn, sf.MultiheadAttention) for layer in converted)
    attention = nn.MultiheadAttention(D_MODEL, NHEAD, batch_first=True)
    for module in (attention, reference.self_attn):
        sf.MultiheadAttention.from_torch(module)
    assert isinstance(sf.LayerNorm.from_torch(reference.norm1), sf.LayerNorm)
    encoder = nn.TransformerEncoder(built, num_layers=2, enable_nested_tensor=False)
    assert encoder(x).shape == x.shape


def test_unfusable_activation_is_rejected():
    with pytest.raises(ValueError, match='activation must be one of "relu", "gelu"'):
        sf.TransformerEncoderLayer(D_MODEL, NHEAD, activation=torch.tanh)
    with pytest.raises(ValueError, match="recompute policy must be one of"):
        sf.TransformerEncoderLayer(D_MODEL, NHEAD, recompute="some")


class TestPolicies:
    def _grads(self, policy, norm_first, x):
        _, layer = _pair(norm_first, "gelu", dropout=0.1)
        sf.recompute(layer, policy)
        torch.manual_seed(123)
        return _outputs_and_grads(layer, x, src_key_padding_mask=_padding(2, 11))

    @pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
    def test_every_policy_gives_the_same_gradients_with_dropout(self, backend, norm_first):
        x = torch.randn(2, 11, D_MODEL)
        out_none, grads_none = self._grads("none", norm_first, x)
        for policy in BRANCH_COVERING_POLICIES[1:]:
            out, grads = self._grads(policy, norm_first, x)
            torch.testing.assert_close(out, out_none, rtol=0, atol=1e-6)
            for g, g_ref in zip(grads, grads_none):
                torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)

    def test_dropout_reproducible_and_active(self, backend):
        x = torch.randn(2, 11, D_MODEL)
        first, _ = self._grads("none", False, x)
        second, _ = self._grads("none", False, x)
        assert torch.equal(first, second)
        torch.manual_seed(5)
        _, layer = _pair(dropout=0.1)
        assert not torch.allclose(layer(x), first)

    def test_switchable_between_steps_and_validated(self):
        _, layer = _pair()
        encoder = nn.TransformerEncoder(layer, num_layers=2)
        sf.recompute(encoder, "qkv+mlp")
        assert all(module.recompute == "qkv+mlp" for module in encoder.layers)
        sf.recompute(encoder, "full")
        encoder(torch.randn(2, 5, D_MODEL)).sum().backward()
        with pytest.raises(ValueError, match="recompute policy must be one of"):
            sf.recompute(encoder, "attention")
        with pytest.raises(ValueError, match="has no slimformer layer"):
            sf.recompute(nn.Linear(2, 2), "none")


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_autocast_matches_torch_and_policies_agree(backend, norm_first):
    reference, _ = _pair(norm_first=norm_first, activation="gelu")
    x = torch.randn(2, 9, D_MODEL)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref, grads_ref = _outputs_and_grads(reference, x)
    results = {}
    for policy in BRANCH_COVERING_POLICIES:
        _, layer = _pair(norm_first=norm_first, activation="gelu", recompute=policy)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[policy] = _outputs_and_grads(layer, x)
        out, grads = results[policy]
        assert out.dtype == out_ref.dtype
        torch.testing.assert_close(out, out_ref, rtol=0.05, atol=0.05)  # bf16 GEMMs: ~2^-8 relative each
        for g, g_ref in zip(grads, grads_ref):
            assert g.dtype == g_ref.dtype
            torch.testing.assert_close(g, g_ref, rtol=0.05, atol=0.05)
        for g, g_none in zip(grads, results["none"][1]):
            torch.testing.assert_close(g, g_none, rtol=0, atol=0)


def test_torch_compile_fullgraph_forward_and_backward(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # dynamo traces the PyTorch path on CPU
    _, layer = _pair(activation="gelu")
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(2, 9, D_MODEL, requires_grad=True)
    out = compiled(x, src_key_padding_mask=_padding(2, 9))
    out.sum().backward()
    expected = layer(x, src_key_padding_mask=_padding(2, 9))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", BRANCH_COVERING_POLICIES)
def test_every_policy_compiles_fullgraph_with_dropout(policy, monkeypatch):
    # aot_eager traces forward and backward as inductor does (inductor itself is
    # covered above) without its C++ build; the seeds come from torch's generator
    # inside the graph, so the compiled step draws the eager step's masks.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _, layer = _pair(activation="gelu", dropout=0.1, recompute=policy)
    layer.train()
    x = torch.randn(2, 9, D_MODEL)
    mask = _padding(2, 9)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    out, grads = _outputs_and_grads(compiled, x, src_key_padding_mask=mask)
    torch.manual_seed(3)
    expected, expected_grads = _outputs_and_grads(layer, x, src_key_padding_mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(grads, expected_grads):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_full_compiles_after_the_dropout_changes(norm_first, monkeypatch):
    # a changed p makes dynamo recompile with p as a dynamic float: one read both inside
    # the checkpoint and after it would break tracing (a node of the region used outside it)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    layer = sf.TransformerEncoderLayer(
        D_MODEL, NHEAD, D_FF, 0.1, batch_first=True, norm_first=norm_first, recompute="full"
    )
    compiled = torch.compile(layer.train(), fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 9, D_MODEL)
    for p in (0.1, 0.2):
        for dropout in (layer.dropout, layer.dropout1, layer.dropout2):
            dropout.p = p
        compiled(x).sum().backward()
    torch._dynamo.reset()


# BERT-base layer dims, seq 512, dropout 0.1, fp32; bytes per token per hidden unit
# (torch's own layer keeps 188 measured this way). Pre-LN may keep one more hidden-sized
# tensor (norm1's output, the attention input): +4.
MEMORY_TARGETS = {"none": 37, "qkv": 25, "mlp": 21, "qkv+mlp": 9, "full": 1}


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
@pytest.mark.parametrize("policy", list(MEMORY_TARGETS))
def test_memory_targets_bert_base(monkeypatch, policy, norm_first):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch path saves exactly what the kernels save
    torch.manual_seed(0)
    layer = sf.TransformerEncoderLayer(
        768, 12, 3072, 0.1, "gelu", batch_first=True, norm_first=norm_first, recompute=policy
    )
    x = torch.randn(1, 512, 768, requires_grad=True)
    kept = measure_activation_memory(layer, x)
    per_unit = kept.per_token(512, 768)
    target = MEMORY_TARGETS[policy] + (4 if norm_first and policy != "full" else 0)
    assert per_unit <= target, f"{policy}: {per_unit:.2f} B/token/hidden, {kept}"


@pytest.mark.parametrize("shape", [(2, 5, 16), (5, 2, 8, 32), (32,)], ids=["narrow", "4-d", "1-d"])
def test_input_of_the_wrong_width_names_src(shape):
    layer = sf.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    with pytest.raises(ValueError, match=re.escape(f"d_model = 32, got shape {shape}")):
        layer(torch.randn(shape))
