"""slimformer.patch of HuggingFace MPNet: fused layers whose relative position bias is
computed inside the attention kernel, equal to HF's, keeping nothing quadratic.

Tiny models from configs (no downloads), on the PyTorch path (TRITON_INTERPRET=0)."""

import copy
import io

import pytest
import torch
from transformers import (
    MPNetConfig,
    MPNetForMaskedLM,
    MPNetForQuestionAnswering,
    MPNetForSequenceClassification,
    MPNetForTokenClassification,
    MPNetModel,
)

from slimformer.integrations.hf.mpnet import FusedMPNetLayerMixin, RelativePositionBias
from slimformer.kernels.attention.reference import relative_positions
from slimformer.memory import measure_activation_memory
from slimformer.patch import patch, patch_summary, unpatch
from slimformer.recompute import POLICIES
from tests.family_checks import (
    assert_dropout_seeded_by_torch,
    assert_embeddings_norm_and_dropout_run_as_one_kernel,
    assert_eval_outputs_match,
    assert_masked_lm_loss_fused,
    refuser,
    spread_layer_norms,
)
from tests.test_patch import _assert_grads_close, _batch, _loss_and_grads

MODELS = {
    "MPNetModel": MPNetModel,
    "MPNetForSequenceClassification": MPNetForSequenceClassification,
    "MPNetForMaskedLM": MPNetForMaskedLM,
    "MPNetForTokenClassification": MPNetForTokenClassification,
    "MPNetForQuestionAnswering": MPNetForQuestionAnswering,
}
TINY = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
TABLE = "relative_attention_bias.weight"


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _model(name="MPNetModel", dropout=0.1, attn="eager", **config):
    torch.manual_seed(0)
    config = MPNetConfig(
        **{**TINY, **config},
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        attn_implementation=attn,
    )
    model = spread_layer_norms(MODELS[name](config))
    with torch.no_grad():  # the bias table away from its initial values
        model.base_model.encoder.relative_attention_bias.weight.normal_()
    return model


@pytest.fixture
def original_refused(monkeypatch):
    """MPNetLayer.forward and HF's (batch, heads, seq, seq) bias raise once called."""
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder, MPNetLayer

    return refuser(monkeypatch, (MPNetLayer, "forward"), (MPNetEncoder, "compute_position_bias"))


@pytest.mark.parametrize("attn", ["eager"])  # MPNet has no sdpa path in transformers
@pytest.mark.parametrize("name", list(MODELS))
def test_eval_outputs_match_with_padding(name, attn, original_refused):
    reference = _model(name, attn=attn).eval()
    model = patch(copy.deepcopy(reference))
    assert all(isinstance(layer, FusedMPNetLayerMixin) for layer in model.base_model.encoder.layer)
    assert_eval_outputs_match(reference, model, *_batch(model.config), original_refused)


@pytest.mark.parametrize("attn", ["eager"])  # MPNet has no sdpa path in transformers
@pytest.mark.parametrize("name", ["MPNetModel", "MPNetForSequenceClassification"])
def test_gradients_match_the_bias_table_included(name, attn, original_refused):
    reference = _model(name, dropout=0.0, attn=attn).train()
    model = patch(copy.deepcopy(reference))
    ids, mask = _batch(model.config)
    expected_loss, expected = _loss_and_grads(reference, ids, mask)
    original_refused()
    loss, grads = _loss_and_grads(model, ids, mask)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    assert (
        any(key.endswith(TABLE) for key in grads) and grads[next(k for k in grads if k.endswith(TABLE))].abs().max() > 0
    )
    _assert_grads_close(grads, expected)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_reference_gradients(policy, original_refused):
    reference = _model("MPNetForSequenceClassification", dropout=0.0, attn="eager").train()
    model = patch(copy.deepcopy(reference), recompute=policy)
    ids, mask = _batch(model.config)
    expected = _loss_and_grads(reference, ids, mask)[1]
    original_refused()
    _assert_grads_close(_loss_and_grads(model, ids, mask)[1], expected)


@pytest.mark.parametrize("seq", [1, 7, 200])
def test_the_kernels_bias_is_hfs_bit_for_bit(seq):
    # the per-offset vector, read at j - i + seq - 1, is HF's (batch, heads, seq, seq) bias
    model = patch(_model("MPNetModel"))
    encoder = model.encoder
    x = torch.zeros(2, seq, TINY["hidden_size"])
    bias = encoder.compute_position_bias(x)
    assert isinstance(bias, RelativePositionBias)
    expected = type(encoder)._original_class.compute_position_bias(encoder, x)
    gathered = bias.per_offset(seq)[:, relative_positions(0, seq, seq, seq, "cpu")]
    assert torch.equal(gathered.expand_as(expected), expected)
    assert torch.equal(bias.materialize(), expected)


def test_keeps_nothing_quadratic():
    # HF keeps (batch, heads, seq, seq) scores, probabilities and the bias; patched, the
    # largest tensor kept for backward grows linearly in seq
    largest = {}
    for seq in (64, 128):
        model = patch(_model("MPNetModel", max_position_embeddings=seq + 2)).train()
        ids = torch.randint(5, 100, (2, seq))
        memory = measure_activation_memory(lambda m=model, i=ids: m(i).last_hidden_state, exclude=model.parameters())
        largest[seq] = max(record.nbytes for record in memory.saved)
    assert largest[128] <= 2 * largest[64], largest


@pytest.mark.parametrize("policy", ["none", "qkv+mlp"])
def test_dropout_is_seeded_by_torch(policy):
    reference = _model("MPNetForSequenceClassification", dropout=0.1)
    model = patch(copy.deepcopy(reference), recompute=policy)
    assert_dropout_seeded_by_torch(reference, model, *_batch(model.config))


def test_embeddings_norm_and_dropout_run_as_one_kernel():
    ids, _ = _batch(_model().config, batch=2, seq=7)
    dy = torch.randn(2, 7, TINY["hidden_size"], generator=torch.Generator().manual_seed(5))
    assert_embeddings_norm_and_dropout_run_as_one_kernel(lambda p: _model(dropout=p), ids, dy)


def test_masked_lm_loss_is_fused():
    reference = _model("MPNetForMaskedLM", dropout=0.0).train()
    model = patch(copy.deepcopy(reference), recompute="qkv+mlp")
    assert type(model).__name__ == "FusedMPNetForMaskedLM"
    assert_masked_lm_loss_fused(reference, model, *_batch(model.config))


def test_attentions_run_the_original_layers_on_hfs_bias():
    reference = _model("MPNetModel", dropout=0.0).eval()
    model = patch(copy.deepcopy(reference))
    ids, mask = _batch(model.config)
    with torch.no_grad():
        out, expected = (m(ids, attention_mask=mask, output_attentions=True) for m in (model, reference))
    assert len(out.attentions) == len(expected.attentions) == 2
    for got, want in zip((*out.attentions, out.last_hidden_state), (*expected.attentions, expected.last_hidden_state)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_summary_unpatch_and_pickle():
    model = _model("MPNetForSequenceClassification")
    keys = list(model.state_dict())
    patch(model)
    assert list(model.state_dict()) == keys
    changes = [swap.change for swap in patch_summary(model).class_swaps]
    assert changes == ["relative position bias computed inside the attention kernels"]
    ids, mask = _batch(model.config)
    buffer = io.BytesIO()
    torch.save(model.eval(), buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    unpatch(model)
    assert type(model.mpnet.encoder).__name__ == "MPNetEncoder"
    assert type(model.mpnet.encoder.layer[0]).__name__ == "MPNetLayer"


def test_gradients_match_on_the_kernels_too(backend):
    # the interpreted kernels read the per-offset bias along the tiles' diagonals
    reference = _model("MPNetModel", dropout=0.0).train()
    model = patch(copy.deepcopy(reference), recompute="qkv")
    ids, mask = _batch(model.config)
    expected_loss, expected = _loss_and_grads(reference, ids, mask)
    loss, grads = _loss_and_grads(model, ids, mask)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    _assert_grads_close(grads, expected)
