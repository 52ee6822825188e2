"""slimformer.patch of HuggingFace DistilBERT: fused blocks and embeddings compute like the originals.

Tiny models from configs (no downloads), on the PyTorch path (TRITON_INTERPRET=0).
"""

import copy
import io

import pytest
import torch
from transformers import (
    DistilBertConfig,
    DistilBertForMaskedLM,
    DistilBertForQuestionAnswering,
    DistilBertForSequenceClassification,
    DistilBertForTokenClassification,
    DistilBertModel,
)

from slimformer.integrations.hf.distilbert import FusedDistilBertLayer
from slimformer.patch import patch, patch_summary, unpatch
from slimformer.recompute import POLICIES

# the BERT tests' batch and comparison helpers, for the same checks
from tests.family_checks import (
    assert_dropout_seeded_by_torch,
    assert_embeddings_norm_and_dropout_run_as_one_kernel,
    assert_eval_outputs_match,
    assert_gradients_match,
    assert_masked_lm_loss_fused,
    refuser,
    spread_layer_norms,
)
from tests.test_patch import _assert_grads_close, _batch, _loss_and_grads

MODELS = {
    "DistilBertModel": DistilBertModel,
    "DistilBertForSequenceClassification": DistilBertForSequenceClassification,
    "DistilBertForMaskedLM": DistilBertForMaskedLM,
    "DistilBertForTokenClassification": DistilBertForTokenClassification,
    "DistilBertForQuestionAnswering": DistilBertForQuestionAnswering,
}
TINY = {"vocab_size": 100, "dim": 32, "n_layers": 2, "n_heads": 2, "hidden_dim": 64, "max_position_embeddings": 64}


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _model(name="DistilBertModel", dropout=0.1, attn="eager", **config):
    torch.manual_seed(0)
    config = DistilBertConfig(
        **{**TINY, **config},
        dropout=dropout,
        attention_dropout=dropout,
        seq_classif_dropout=dropout,
        qa_dropout=dropout,
        attn_implementation=attn,
    )
    return spread_layer_norms(MODELS[name](config))


def _blocks(model):
    return model.base_model.transformer.layer


@pytest.fixture
def original_forward_refused(monkeypatch):
    from transformers.models.distilbert.modeling_distilbert import TransformerBlock

    return refuser(monkeypatch, (TransformerBlock, "forward"))


@pytest.mark.parametrize("attn", ["eager", "sdpa", "slimformer"])
@pytest.mark.parametrize("name", list(MODELS))
def test_eval_outputs_match_with_padding(name, attn, original_forward_refused):
    reference = _model(name, attn=attn).eval()
    model = patch(copy.deepcopy(reference))
    assert all(isinstance(block, FusedDistilBertLayer) for block in _blocks(model))
    assert_eval_outputs_match(reference, model, *_batch(model.config), original_forward_refused)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_match_without_dropout(name, attn, original_forward_refused):
    reference = _model(name, dropout=0.0, attn=attn).train()
    model = patch(copy.deepcopy(reference))
    assert_gradients_match(reference, model, *_batch(model.config), original_forward_refused)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["DistilBertModel", "DistilBertForSequenceClassification"])
def test_every_policy_gives_the_reference_gradients(name, policy, original_forward_refused):
    reference = _model(name, dropout=0.0, attn="sdpa").train()
    model = patch(copy.deepcopy(reference), recompute=policy)
    assert {block.recompute for block in _blocks(model)} == {policy}
    ids, mask = _batch(model.config)
    expected = _loss_and_grads(reference, ids, mask)[1]
    original_forward_refused()
    _assert_grads_close(_loss_and_grads(model, ids, mask)[1], expected)


@pytest.mark.parametrize("policy", POLICIES)
def test_dropout_in_train_mode_is_seeded_by_torch_under_every_policy(policy):
    reference = _model("DistilBertForSequenceClassification", dropout=0.1)
    model = patch(copy.deepcopy(reference), recompute=policy)
    assert_dropout_seeded_by_torch(reference, model, *_batch(model.config))


def test_embeddings_norm_and_dropout_run_as_one_kernel():
    ids, _ = _batch(_model().config, batch=2, seq=7)
    dy = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(5))
    assert_embeddings_norm_and_dropout_run_as_one_kernel(lambda p: _model(dropout=p), ids, dy)


def test_state_dict_parameters_summary_and_unpatch():
    model = _model("DistilBertForSequenceClassification")
    modules = dict(model.named_modules())
    parameters = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert patch(model) is model
    assert list(model.state_dict()) == keys
    assert all(p is parameters[name] for name, p in model.named_parameters())
    summary = patch_summary(model)
    assert {swap.name for swap in summary.swapped} == {
        "distilbert.embeddings.LayerNorm",
        "distilbert.embeddings.dropout",
        "distilbert.transformer.layer.0",
        "distilbert.transformer.layer.1",
    }
    assert "FusedDistilBertTransformerBlock" in str(summary)
    model.eval()
    assert unpatch(model) is model
    assert all(module is modules[name] for name, module in model.named_modules())
    assert dict(model.named_modules()).keys() == modules.keys()
    assert type(model.distilbert.transformer.layer[0]).__name__ == "TransformerBlock"
    assert not any(module.training for module in model.modules())
    with pytest.raises(ValueError, match="is not patched"):
        unpatch(model)


@pytest.mark.parametrize("policy", ["none", "qkv+mlp"])
def test_masked_lm_loss_is_fused_with_the_vocabulary_projection(policy):
    reference = _model("DistilBertForMaskedLM", dropout=0.0).train()
    model = patch(copy.deepcopy(reference), recompute=policy)
    assert type(model).__name__ == "FusedDistilBertForMaskedLM"
    assert [swap.change for swap in patch_summary(model).class_swaps] == ["masked-LM loss fused with the decoder"]
    assert_masked_lm_loss_fused(reference, model, *_batch(model.config))
    unpatch(model)
    assert type(model) is DistilBertForMaskedLM


def test_unsupported_blocks_are_left_with_reasons():
    model = patch(_model("DistilBertModel", activation="silu"))
    reasons = {item.name: item.reason for item in patch_summary(model).left}
    assert "activation 'silu' has no fused kernel" in reasons["transformer.layer.0"]

    model = _model("DistilBertModel")
    block_class = type(model.transformer.layer[0])
    subclass = type("MyBlock", (block_class,), {})
    for block in model.transformer.layer:
        block.__class__ = subclass
    reasons = {item.name: item.reason for item in patch_summary(patch(model)).left}
    assert "not a DistilBERT block verified" in reasons["transformer.layer.0"]


def test_hidden_states_attentions_checkpointing_and_pickling():
    reference = _model("DistilBertModel", dropout=0.0).train()
    model = patch(copy.deepcopy(reference))
    ids, mask = _batch(model.config)
    outs = [m(ids, attention_mask=mask, output_hidden_states=True).hidden_states for m in (model, reference)]
    for out, expected in zip(*outs, strict=True):
        torch.testing.assert_close(out, expected)
    with torch.no_grad():  # attentions asked for: the original blocks run that call
        out, expected = (m.eval()(ids, attention_mask=mask, output_attentions=True) for m in (model, reference))
    assert len(out.attentions) == len(expected.attentions) == model.config.n_layers
    for got, want in zip((*out.attentions, out.last_hidden_state), (*expected.attentions, expected.last_hidden_state)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    model.train().activation_checkpointing_enable()  # transformers' own checkpointing wraps the fused blocks
    reference.train()
    _assert_grads_close(_loss_and_grads(model, ids, mask)[1], _loss_and_grads(reference, ids, mask)[1])

    fresh = patch(_model("DistilBertForSequenceClassification")).eval()
    buffer = io.BytesIO()
    torch.save(fresh, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert type(loaded.distilbert.transformer.layer[0]) is type(fresh.distilbert.transformer.layer[0])
    torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, fresh(ids, attention_mask=mask).logits)
    unpatch(loaded)
    assert type(loaded.distilbert.transformer.layer[0]).__name__ == "TransformerBlock"


def test_hooks_on_submodules_of_a_fused_block_fire():
    reference = _model("DistilBertModel", dropout=0.0).eval()
    model = patch(copy.deepcopy(reference))
    paths = ("attention", "attention.q_lin", "ffn", "output_layer_norm")
    calls = {}
    for m in (model, reference):
        block = m.transformer.layer[0]
        for path in paths:
            block.get_submodule(path).register_forward_hook(
                lambda module, args, out, key=(id(m), path): calls.setdefault(key, []).append(out)
            )
    ids, mask = _batch(model.config)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, attention_mask=mask).last_hidden_state, reference(ids, attention_mask=mask).last_hidden_state
        )
    for path in paths:
        got, want = calls[(id(model), path)], calls[(id(reference), path)]
        assert len(got) == len(want) == 1
        torch.testing.assert_close(got, want)
