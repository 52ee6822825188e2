"""slimformer.TransformerEncoderLayer vs torch's, recompute policies, and memory targets."""

import re

import pytest
import torch
from torch import nn

import slimformer as sf
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
        D_MODEL, NHEAD, D_FF, dropout, activation, batch_first=batch_first, norm_first=norm_first,
        recompute=recompute, **kwargs,
    )  # fmt: skip
    layer.load_state_dict(reference.state_dict())
    return reference, layer


def _outputs_and_grads(layer, x, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    out = layer(x, **kwargs)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
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
            torch.testing.assert_close(encoder(x, src_key_padding_mask=padding)[~padding], out_ref, rtol=1e-4, atol=1e-4)


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
    # the checkpoint and after it broke tracing (a node of the region used outside it)
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
