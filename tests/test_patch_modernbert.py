"""slimformer.patch of HuggingFace ModernBERT: fused layers (RoPE, the fused attention with the
local layers' sliding window, the GeGLU MLP on the fused MLP kernel), fused embeddings.

Tiny models from configs (no downloads), on the PyTorch path (TRITON_INTERPRET=0)."""

import copy

import pytest
import torch
from transformers import ModernBertConfig, ModernBertForMaskedLM, ModernBertForSequenceClassification, ModernBertModel

from slimformer.integrations.hf.modernbert import FusedModernBertMLPMixin
from slimformer.memory import measure_activation_memory
from slimformer.patch import patch, patch_summary, unpatch
from slimformer.recompute import POLICIES, recompute
from tests.family_checks import (
    assert_embeddings_norm_and_dropout_run_as_one_kernel,
    assert_gradients_match,
    assert_masked_lm_loss_fused,
    refuser,
    spread_layer_norms,
)
from tests.test_patch import _batch, _outputs

MODELS = {
    "ModernBertModel": ModernBertModel,
    "ModernBertForSequenceClassification": ModernBertForSequenceClassification,
    "ModernBertForMaskedLM": ModernBertForMaskedLM,
}
TINY = dict(
    vocab_size=100,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    cls_token_id=1,
    sep_token_id=2,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    intermediate_size=48,
    local_attention=4,  # windows shorter than the test batch's rows
)


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _model(name="ModernBertModel", dropout=0.0, attn="sdpa", **config):
    torch.manual_seed(0)
    config = ModernBertConfig(**{**TINY, **config}, mlp_dropout=dropout, attn_implementation=attn)
    return spread_layer_norms(MODELS[name](config))


@pytest.fixture
def original_refused(monkeypatch):
    from transformers.models.modernbert.modeling_modernbert import (
        ModernBertAttention,
        ModernBertEncoderLayer,
        ModernBertMLP,
    )

    return refuser(
        monkeypatch,
        (ModernBertMLP, "forward"),
        (ModernBertAttention, "forward"),
        (ModernBertEncoderLayer, "forward"),
    )


def _mlps(model):
    return [layer.mlp for layer in model.base_model.layers]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(MODELS))
def test_eval_outputs_match_at_real_positions(name, attn, original_refused):
    # a padded query farther than the window from every token has no allowed key: the fused
    # kernel gives it 0 (as SDPA does), eager HF the mean of its values; no real position
    # reads it (it is a padding key to every later layer)
    reference = _model(name, attn=attn).eval()
    model = patch(copy.deepcopy(reference))
    assert all(isinstance(mlp, FusedModernBertMLPMixin) for mlp in _mlps(model))
    ids, mask = _batch(model.config)
    real = mask.bool()
    with torch.no_grad():
        expected = _outputs(reference, ids, mask)
        original_refused()
        for out, value in zip(_outputs(model, ids, mask), expected, strict=True):
            if out.shape[:2] == mask.shape:
                out, value = out[real], value[real]
            torch.testing.assert_close(out, value, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_match_under_every_policy(policy, original_refused):
    reference = _model("ModernBertForSequenceClassification").train()
    model = patch(copy.deepcopy(reference), recompute=policy)
    assert {mlp.recompute for mlp in _mlps(model)} == {policy}
    assert_gradients_match(reference, model, *_batch(model.config), original_refused)


def test_mlp_dropout_is_seeded_by_torch_and_recompute_keeps_less():
    model = patch(_model("ModernBertModel", dropout=0.3)).train()
    ids, mask = _batch(model.config)
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        runs.append(model(ids, attention_mask=mask).last_hidden_state)
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    kept = {}
    for policy in ("none", "mlp"):
        recompute(model, policy)
        mlp = _mlps(model)[1]
        x = torch.randn(2, 64, 32, requires_grad=True)
        kept[policy] = measure_activation_memory(mlp, x).saved_bytes
    # none keeps Wi's output (2 x intermediate per token); mlp keeps nothing but x
    assert kept["none"] >= 2 * 64 * 2 * 48 * 4 and kept["mlp"] < kept["none"] / 4


def test_summary_hooks_and_unpatch():
    model = _model("ModernBertForSequenceClassification")
    keys = list(model.state_dict())
    patch(model)
    assert list(model.state_dict()) == keys
    assert "FusedModernBertEncoderLayer" in str(patch_summary(model))
    calls = []
    model.model.layers[0].attn.Wqkv.register_forward_hook(lambda *a: calls.append("Wqkv"))
    model.model.layers[1].mlp.Wi.register_forward_hook(lambda *a: calls.append("Wi"))
    ids, mask = _batch(model.config)
    model.eval()(ids, attention_mask=mask)
    assert calls == ["Wqkv", "Wi"]  # hooked: those calls ran the original forwards
    unpatch(model)
    assert type(model.model.layers[0]).__name__ == "ModernBertEncoderLayer"
    assert type(model.model.layers[0].mlp).__name__ == "ModernBertMLP"


def test_tanh_gelu_mlp_is_left_with_its_reason():
    model = patch(_model("ModernBertModel", hidden_activation="gelu_pytorch_tanh"))
    left = {item.name: item.reason for item in patch_summary(model).left}
    assert "its MLP: its activation is a GELUTanh; the fused kernel's geglu is the exact gelu" in left["layers.0"]


def test_unpad_packs_the_real_tokens():
    # (real positions equal the padded model's: tests/test_unpad_families.py)
    model = patch(_model("ModernBertModel"), unpad=True)
    assert type(model).__name__ == "UnpaddedModernBertModel"


def test_embeddings_norm_and_drop_run_as_one_kernel():
    ids, _ = _batch(_model().config, batch=2, seq=7)
    dy = torch.randn(2, 7, TINY["hidden_size"], generator=torch.Generator().manual_seed(5))
    assert_embeddings_norm_and_dropout_run_as_one_kernel(
        lambda p: _model(embedding_dropout=p), ids, dy, norm="norm", dropout="drop"
    )


def test_local_layers_take_the_sliding_window_and_skip_what_is_outside(monkeypatch):
    # global layers attend everywhere, local ones (HF: |i - j| <= local_attention // 2) get
    # the kernels' window, whose tiles outside it are never visited
    from slimformer.integrations.hf import modernbert

    windows = []
    kernel = modernbert.attention
    monkeypatch.setattr(modernbert, "attention", lambda *a, **k: windows.append(k["window"]) or kernel(*a, **k))
    model = patch(_model("ModernBertModel")).eval()
    ids, mask = _batch(model.config)
    model(ids, attention_mask=mask)
    expected = [None if kind == "full_attention" else TINY["local_attention"] // 2 for kind in model.config.layer_types]
    assert windows == expected and None in windows and 2 in windows


def test_gradients_match_on_the_kernels_too(backend):
    # the interpreted kernels: the local layers' windows skip tiles, RoPE'd q and k
    reference = _model("ModernBertModel", max_position_embeddings=64).train()
    model = patch(copy.deepcopy(reference), recompute="qkv")
    assert_gradients_match(reference, model, *_batch(model.config, seq=40), lambda: None)


def test_masked_lm_loss_is_fused():
    reference = _model("ModernBertForMaskedLM").train()
    model = patch(copy.deepcopy(reference), recompute="qkv+mlp")
    assert type(model).__name__ == "FusedModernBertForMaskedLM"
    assert_masked_lm_loss_fused(reference, model, *_batch(model.config))
