"""slimformer.patch of HuggingFace ALBERT: fused (shared) layers and embeddings compute like the originals.

Tiny models from configs (no downloads), on the PyTorch path (TRITON_INTERPRET=0).
"""

import copy
import io

import pytest
import torch
from transformers import (
    AlbertConfig,
    AlbertForMaskedLM,
    AlbertForQuestionAnswering,
    AlbertForSequenceClassification,
    AlbertForTokenClassification,
    AlbertModel,
)

from slimformer.integrations.hf.albert import FusedAlbertLayerMixin
from slimformer.patch import patch, patch_summary, unpatch
from slimformer.recompute import POLICIES
from tests.family_checks import (
    assert_dropout_seeded_by_torch,
    assert_embeddings_norm_and_dropout_run_as_one_kernel,
    assert_eval_outputs_match,
    assert_gradients_match,
    assert_masked_lm_loss_fused,
    refuser,
    spread_layer_norms,
)

# the BERT tests' batch and comparison helpers, for the same checks
from tests.helpers import assert_within_reference_error
from tests.test_patch import _assert_grads_close, _batch, _loss_and_grads

MODELS = {
    "AlbertModel": AlbertModel,
    "AlbertForSequenceClassification": AlbertForSequenceClassification,
    "AlbertForMaskedLM": AlbertForMaskedLM,
    "AlbertForTokenClassification": AlbertForTokenClassification,
    "AlbertForQuestionAnswering": AlbertForQuestionAnswering,
}
# One layer applied three times, as ALBERT-base applies one twelve times.
TINY = {
    "vocab_size": 100,
    "embedding_size": 16,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
# Two groups of two layers, over four applications: each layer runs twice.
GROUPED = {"num_hidden_layers": 4, "num_hidden_groups": 2, "inner_group_num": 2}


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _model(name="AlbertModel", dropout=0.1, attn="eager", **config):
    torch.manual_seed(0)
    config = AlbertConfig(
        **{**TINY, **config},
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        classifier_dropout_prob=dropout,
        attn_implementation=attn,
    )
    return spread_layer_norms(MODELS[name](config))


def _layers(model):
    return [layer for group in model.base_model.encoder.albert_layer_groups for layer in group.albert_layers]


@pytest.fixture
def original_forward_refused(monkeypatch):
    from transformers.models.albert.modeling_albert import AlbertLayer

    return refuser(monkeypatch, (AlbertLayer, "forward"))


@pytest.mark.parametrize("attn", ["eager", "sdpa", "slimformer"])
@pytest.mark.parametrize("name", list(MODELS))
def test_eval_outputs_match_with_padding(name, attn, original_forward_refused):
    reference = _model(name, attn=attn).eval()
    model = patch(copy.deepcopy(reference))
    assert all(isinstance(layer, FusedAlbertLayerMixin) for layer in _layers(model))
    assert_eval_outputs_match(reference, model, *_batch(model.config), original_forward_refused)


@pytest.mark.parametrize("config", [{}, GROUPED], ids=["one-layer", "two-groups"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_match_without_dropout(name, attn, config, original_forward_refused):
    reference = _model(name, dropout=0.0, attn=attn, **config).train()
    model = patch(copy.deepcopy(reference))
    assert_gradients_match(reference, model, *_batch(model.config), original_forward_refused)


def test_outputs_and_shared_layer_gradients_within_twice_hf_fp32_error_of_fp64():
    # The precision contract with a float64 oracle: HF's model in float64 on the same
    # (fp32-representable) weights; ours in fp32 may err at most twice as much as HF's fp32.
    reference = _model("AlbertModel", dropout=0.0, attn="eager").train()
    exact = copy.deepcopy(reference).double()
    model = patch(copy.deepcopy(reference))
    ids, mask = _batch(model.config)
    results = [_loss_and_grads(m, ids, mask) for m in (model, reference, exact)]
    outputs = [m(ids, attention_mask=mask).last_hidden_state.detach() for m in (model, reference, exact)]
    assert_within_reference_error("last_hidden_state", *outputs)
    (_, grads), (_, hf_grads), (_, exact_grads) = results
    for name in exact_grads:
        assert_within_reference_error(name, grads[name], hf_grads[name], exact_grads[name], ulps=64)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("config", [{}, GROUPED], ids=["one-layer", "two-groups"])
def test_every_policy_gives_the_reference_gradients_for_shared_layers(policy, config, original_forward_refused):
    reference = _model("AlbertForSequenceClassification", dropout=0.0, attn="sdpa", **config).train()
    model = patch(copy.deepcopy(reference), recompute=policy)
    assert {layer.recompute for layer in _layers(model)} == {policy}
    ids, mask = _batch(model.config)
    expected = _loss_and_grads(reference, ids, mask)[1]
    original_forward_refused()
    _assert_grads_close(_loss_and_grads(model, ids, mask)[1], expected)


@pytest.mark.parametrize("policy", POLICIES)
def test_dropout_in_train_mode_is_seeded_by_torch_under_every_policy(policy):
    reference = _model("AlbertForSequenceClassification", dropout=0.1)
    model = patch(copy.deepcopy(reference), recompute=policy)
    assert_dropout_seeded_by_torch(reference, model, *_batch(model.config))


def test_each_application_of_the_shared_layer_draws_its_own_dropout_mask():
    # One layer object runs at every application: each call draws its own seed from torch's
    # generator (as HF's nn.Dropout draws anew at each call), so two applications to the
    # same input drop differently, and the same generator state drops the same.
    model = patch(_model("AlbertModel", dropout=0.5)).train()
    layer = _layers(model)[0]
    x = torch.randn(2, 5, 32)
    first, second = layer(x), layer(x)
    assert not torch.equal(first, second)
    torch.manual_seed(11)
    again = layer(x)
    torch.manual_seed(11)
    torch.testing.assert_close(layer(x), again, rtol=0, atol=0)


def test_embeddings_norm_and_dropout_run_as_one_kernel():
    ids, _ = _batch(_model().config, batch=2, seq=7)
    dy = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(5))
    assert_embeddings_norm_and_dropout_run_as_one_kernel(lambda p: _model(dropout=p), ids, dy)


def test_state_dict_parameters_summary_and_unpatch():
    model = _model("AlbertForSequenceClassification", **GROUPED)
    modules = dict(model.named_modules())
    parameters = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert patch(model) is model
    assert list(model.state_dict()) == keys
    assert all(p is parameters[name] for name, p in model.named_parameters())
    summary = patch_summary(model)
    groups = "albert.encoder.albert_layer_groups"
    assert {swap.name for swap in summary.swapped} == {
        "albert.embeddings.LayerNorm",
        "albert.embeddings.dropout",
        *(f"{groups}.{g}.albert_layers.{i}" for g in (0, 1) for i in (0, 1)),
    }
    assert "FusedAlbertLayer" in str(summary)
    model.eval()
    assert unpatch(model) is model
    assert all(module is modules[name] for name, module in model.named_modules())
    assert dict(model.named_modules()).keys() == modules.keys()
    assert type(_layers(model)[0]).__name__ == "AlbertLayer"
    assert not any(module.training for module in model.modules())
    with pytest.raises(ValueError, match="is not patched"):
        unpatch(model)


@pytest.mark.parametrize("policy", ["none", "qkv+mlp"])
def test_masked_lm_loss_is_fused_with_the_vocabulary_projection(policy):
    reference = _model("AlbertForMaskedLM", dropout=0.0).train()
    model = patch(copy.deepcopy(reference), recompute=policy)
    assert type(model).__name__ == "FusedAlbertForMaskedLM"
    assert [swap.change for swap in patch_summary(model).class_swaps] == ["masked-LM loss fused with the decoder"]
    assert model.predictions.decoder.weight is model.albert.embeddings.word_embeddings.weight  # still tied
    assert_masked_lm_loss_fused(reference, model, *_batch(model.config))
    unpatch(model)
    assert type(model) is AlbertForMaskedLM


def test_unsupported_layers_are_left_with_reasons():
    model = patch(_model("AlbertModel", hidden_act="silu"))
    reasons = {item.name: item.reason for item in patch_summary(model).left}
    assert "hidden_act 'silu' has no fused kernel" in reasons["encoder.albert_layer_groups.0.albert_layers.0"]

    model = _model("AlbertModel")
    layer_class = type(_layers(model)[0])
    subclass = type("MyLayer", (layer_class,), {})
    for layer in _layers(model):
        layer.__class__ = subclass
    reasons = {item.name: item.reason for item in patch_summary(patch(model)).left}
    assert "not an ALBERT layer verified" in reasons["encoder.albert_layer_groups.0.albert_layers.0"]


def test_hidden_states_attentions_and_pickling():
    reference = _model("AlbertModel", dropout=0.0).train()
    model = patch(copy.deepcopy(reference))
    ids, mask = _batch(model.config)
    outs = [m(ids, attention_mask=mask, output_hidden_states=True).hidden_states for m in (model, reference)]
    assert len(outs[0]) == len(outs[1]) == model.config.num_hidden_layers + 1
    for out, expected in zip(*outs, strict=True):
        torch.testing.assert_close(out, expected)
    with torch.no_grad():  # attentions asked for: the original layers run that call
        out, expected = (m.eval()(ids, attention_mask=mask, output_attentions=True) for m in (model, reference))
    assert len(out.attentions) == len(expected.attentions) == model.config.num_hidden_layers
    for got, want in zip((*out.attentions, out.last_hidden_state), (*expected.attentions, expected.last_hidden_state)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    fresh = patch(_model("AlbertForSequenceClassification")).eval()
    buffer = io.BytesIO()
    torch.save(fresh, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert type(_layers(loaded)[0]) is type(_layers(fresh)[0])
    torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, fresh(ids, attention_mask=mask).logits)
    unpatch(loaded)
    assert type(_layers(loaded)[0]).__name__ == "AlbertLayer"


def test_hooks_on_submodules_of_a_fused_layer_fire_at_every_application():
    reference = _model("AlbertModel", dropout=0.0).eval()
    model = patch(copy.deepcopy(reference))
    paths = ("attention", "attention.query", "ffn", "full_layer_layer_norm")
    calls = {}
    for m in (model, reference):
        layer = _layers(m)[0]
        for path in paths:
            layer.get_submodule(path).register_forward_hook(
                lambda module, args, out, key=(id(m), path): calls.setdefault(key, []).append(out)
            )
    ids, mask = _batch(model.config)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, attention_mask=mask).last_hidden_state, reference(ids, attention_mask=mask).last_hidden_state
        )
    for path in paths:
        got, want = calls[(id(model), path)], calls[(id(reference), path)]
        assert len(got) == len(want) == model.config.num_hidden_layers
        torch.testing.assert_close(got, want)
