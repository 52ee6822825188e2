"""slimformer.patch on models without BERT-family layers: it swaps what computes the
same thing and the summary accounts for every attention, MLP and norm it leaves.

Tiny models from configs (no downloads), on the PyTorch path.
"""

import copy
import pickle

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import slimformer as sf  # noqa: E402
from slimformer.integrations.hf.llama import FusedLlamaStyleRMSNorm  # noqa: E402
from slimformer.patch import patch_summary, unpatch  # noqa: E402

LLAMA = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 100,
}  # fmt: skip


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _llama():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    with torch.no_grad():  # norm weights away from their initial 1
        for module in model.modules():
            if isinstance(module, transformers.models.llama.modeling_llama.LlamaRMSNorm):
                module.weight.uniform_(0.5, 1.5)
    return model


def _logits_and_grads(model, ids):
    logits = model(ids).logits
    logits.float().square().sum().backward()
    return logits, [p.grad for p in model.parameters()]


def test_gpt2_summary_lists_attention_and_mlp_left():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 100, (2, 7))
    expected = model(ids).logits
    patched = sf.patch(model)
    summary = patch_summary(patched)
    assert summary.title() == "slimformer.patch(GPT2LMHeadModel, recompute=None): 5 swapped, 4 left"
    reasons = {left.name: left.reason for left in summary.left}
    assert set(reasons) == {f"transformer.h.{i}.{part}" for i in (0, 1) for part in ("attn", "mlp")}
    assert "set_attn_implementation('slimformer')" in reasons["transformer.h.0.attn"]
    assert reasons["transformer.h.1.mlp"].startswith("no drop-in for this MLP")
    torch.testing.assert_close(patched(ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_rmsnorm_swapped_computes_the_same(dtype):
    model = _llama()
    ids = torch.randint(0, 100, (2, 17))
    reference = _logits_and_grads(copy.deepcopy(model).double(), ids)
    eager = _logits_and_grads(copy.deepcopy(model).to(dtype), ids)
    patched_model = sf.patch(copy.deepcopy(model).to(dtype))
    summary = patch_summary(patched_model)
    assert summary.title() == "slimformer.patch(LlamaForCausalLM, recompute=None): 5 swapped, 4 left"
    norms = [swap.replacement for swap in summary.swapped]
    assert all(isinstance(norm, FusedLlamaStyleRMSNorm) for norm in norms)
    assert all(isinstance(norm, transformers.models.llama.modeling_llama.LlamaRMSNorm) for norm in norms)
    assert {left.name.rpartition(".")[2] for left in summary.left} == {"self_attn", "mlp"}
    patched = _logits_and_grads(patched_model, ids)
    # the forward is the original's: fp32 statistics, rounded once to the input's dtype,
    # then the weight product in that dtype
    torch.testing.assert_close(patched[0], eager[0], rtol=0, atol=0)
    # backward rebuilds the normalised input from the rounded output: in each parameter its
    # error against float64 stays within 1.25x of the original's own error (1.05x measured)
    for ref, ours, theirs in zip(reference[1], patched[1], eager[1]):
        our_error = (ours.double() - ref).norm()
        their_error = (theirs.double() - ref).norm()
        assert our_error <= 1.25 * their_error + 1e-6 * ref.norm()


def test_llama_rmsnorm_float64_pickling_and_unpatch():
    model = _llama()
    norm = model.model.norm
    x = torch.randn(3, 64, dtype=torch.float64)
    patched = sf.patch(model)
    fused = patched.model.norm
    assert type(fused).__name__ == "FusedLlamaRMSNorm" and fused.weight is norm.weight
    torch.testing.assert_close(fused(x), norm(x), rtol=0, atol=0)  # float64 runs the original forward
    again = pickle.loads(pickle.dumps(fused))
    y = torch.randn(3, 64)
    torch.testing.assert_close(again(y), norm(y))
    assert unpatch(patched).model.norm is norm


def test_norms_that_compute_otherwise_are_left_with_the_reason():
    llama_norm = transformers.models.llama.modeling_llama.LlamaRMSNorm

    class ShiftedNorm(llama_norm):
        def forward(self, hidden_states):
            return super().forward(hidden_states) + 1

    gemma = transformers.models.gemma.modeling_gemma.GemmaRMSNorm(8)
    t5 = transformers.models.t5.modeling_t5.T5LayerNorm(8)
    model = nn.ModuleDict({"shifted": ShiftedNorm(8), "gemma": gemma, "t5": t5, "group": nn.GroupNorm(2, 8)})
    summary = patch_summary(model)  # not patched: never raises
    assert not summary.patched and summary.swapped == ()
    reasons = {left.name: left.reason for left in summary.left}
    assert reasons["shifted"] == reasons["t5"] == "its forward is not LlamaRMSNorm's (checked against its source)"
    assert "1 + weight" in reasons["gemma"] and "group statistics" in reasons["group"]
    with pytest.warns(UserWarning, match="nothing to patch in ModuleDict"):
        assert sf.patch(model) is model


def test_summary_of_an_unpatched_model_reports_instead_of_raising():
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    assert str(patch_summary(plain)).splitlines()[0] == "Sequential, not patched: 0 swapped, 0 left"
    model = nn.Sequential(nn.LayerNorm(4), nn.MultiheadAttention(4, 2))
    summary = patch_summary(model)
    assert [left.reason for left in summary.left] == [
        "not patched (slimformer.patch would swap it for slimformer LayerNorm)",
        "not patched (slimformer.patch would swap it for slimformer MultiheadAttention)",
    ]
    assert type(model[0]) is nn.LayerNorm  # nothing changed
    with pytest.raises(ValueError, match="is not patched"):
        unpatch(model)


def test_standalone_multihead_attention_is_swapped():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 5, 16)
    expected, _ = mha(x, x, x, need_weights=False)
    model = sf.patch(nn.ModuleList([mha]))
    assert type(model[0]) is sf.MultiheadAttention and model[0].in_proj_weight is mha.in_proj_weight
    out, _ = model[0](x, x, x, need_weights=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_patch_swaps_torchs_modules_under_the_global_drop_in_pattern(monkeypatch):
    # `torch.nn.LayerNorm = sf.LayerNorm` (and the others) rebinds torch.nn's names, not the
    # classes torch's own modules are made of: patch still recognises those
    from torch.nn.modules import activation, normalization, transformer

    for name in ("LayerNorm", "RMSNorm", "MultiheadAttention", "TransformerEncoderLayer"):
        monkeypatch.setattr(nn, name, getattr(sf, name))
    model = nn.Sequential(
        transformer.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
        normalization.LayerNorm(16),
        normalization.RMSNorm(16),
    )
    model.add_module("attention", activation.MultiheadAttention(16, 2, batch_first=True))
    sf.patch(model)
    assert [type(m) for m in model] == [sf.TransformerEncoderLayer, sf.LayerNorm, sf.RMSNorm, sf.MultiheadAttention]
