"""unpad=True for the families that build their mask inside forward (DistilBERT, ALBERT):
real positions equal the padded model's, kept memory follows the real tokens, and the
packing reaches the layers for the call only."""

import copy

import pytest
import torch
from transformers import (
    AlbertConfig,
    AlbertForSequenceClassification,
    AlbertModel,
    DistilBertConfig,
    DistilBertForMaskedLM,
    DistilBertModel,
    ModernBertConfig,
    ModernBertForSequenceClassification,
    ModernBertModel,
    MPNetConfig,
    MPNetForSequenceClassification,
    MPNetModel,
)

import slimformer as sf
from slimformer.memory import measure_activation_memory
from slimformer.recompute import POLICIES
from tests.family_checks import spread_layer_norms
from tests.test_patch import _assert_grads_close
from tests.test_unpad import MASKS, _batch

ALBERT = dict(
    vocab_size=100,
    embedding_size=16,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)
DISTILBERT = dict(vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64)


def _albert(model_class, dropout, attn):
    return model_class(
        AlbertConfig(
            **ALBERT,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            classifier_dropout_prob=dropout,
            attn_implementation=attn,
        )
    )


def _distilbert(model_class, dropout, attn):
    return model_class(
        DistilBertConfig(
            **DISTILBERT,
            dropout=dropout,
            attention_dropout=dropout,
            seq_classif_dropout=dropout,
            attn_implementation=attn,
        )
    )


def _mpnet(model_class, dropout, attn):
    config = MPNetConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        attn_implementation="eager",  # MPNet's only one in transformers
    )
    model = model_class(config)
    with torch.no_grad():
        model.base_model.encoder.relative_attention_bias.weight.normal_()
    return model


def _modernbert(model_class, dropout, attn):
    config = ModernBertConfig(
        vocab_size=100,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        hidden_size=32,
        num_hidden_layers=3,  # one global layer, two local ones
        num_attention_heads=2,
        intermediate_size=48,
        local_attention=4,
        attention_dropout=dropout,
        mlp_dropout=dropout,
        embedding_dropout=dropout,
        attn_implementation=attn if attn != "slimformer" else "sdpa",
    )
    return model_class(config)


MODELS = {
    "AlbertModel": lambda dropout, attn: _albert(AlbertModel, dropout, attn),
    "AlbertForSequenceClassification": lambda dropout, attn: _albert(AlbertForSequenceClassification, dropout, attn),
    "DistilBertModel": lambda dropout, attn: _distilbert(DistilBertModel, dropout, attn),
    "DistilBertForMaskedLM": lambda dropout, attn: _distilbert(DistilBertForMaskedLM, dropout, attn),
    "MPNetModel": lambda dropout, attn: _mpnet(MPNetModel, dropout, attn),
    "MPNetForSequenceClassification": lambda dropout, attn: _mpnet(MPNetForSequenceClassification, dropout, attn),
    "ModernBertModel": lambda dropout, attn: _modernbert(ModernBertModel, dropout, attn),
    "ModernBertForSequenceClassification": lambda dropout, attn: _modernbert(
        ModernBertForSequenceClassification, dropout, attn
    ),
}
BASE = {"AlbertModel", "DistilBertModel", "MPNetModel", "ModernBertModel"}
# attention that depends on positions (a relative bias, a window): padding between tokens runs padded
POSITIONAL = {"MPNetModel", "ModernBertModel"}


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _model(name, dropout=0.0, attn="sdpa"):
    torch.manual_seed(0)
    return spread_layer_norms(MODELS[name](dropout, attn))


def _pair(name, recompute=None, **kwargs):
    """(padded patched, unpadded patched) copies of one model."""
    model = _model(name, **kwargs)
    return sf.patch(copy.deepcopy(model), recompute), sf.patch(copy.deepcopy(model), recompute, unpad=True)


def _varlen_calls(monkeypatch):
    from slimformer.integrations.hf import bert, modernbert

    calls = []
    for module in (bert, modernbert):
        real = module.varlen_attention
        monkeypatch.setattr(module, "varlen_attention", lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    return calls


@pytest.mark.parametrize("attn", ["eager", "sdpa", "slimformer"])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("name", sorted(BASE))
def test_hidden_states_equal_at_real_positions_zero_at_padding(name, mask_name, attn, monkeypatch):
    padded, unpadded = (m.eval() for m in _pair(name, attn=attn))
    assert type(unpadded).__name__ == f"Unpadded{name}"
    ids, mask = _batch(padded.config, mask_name)
    calls = _varlen_calls(monkeypatch)
    with torch.no_grad():
        expected = padded(ids, attention_mask=mask, output_hidden_states=True)
        assert not calls
        out = unpadded(ids, attention_mask=mask, output_hidden_states=True)
    if name in POSITIONAL and mask_name == "holes":  # its offsets count the padding: runs padded
        assert not calls
        torch.testing.assert_close(out.last_hidden_state, expected.last_hidden_state, rtol=1e-5, atol=1e-5)
        return
    assert len(calls) == padded.config.num_hidden_layers  # every layer (every application) ran packed
    real = mask.bool()
    torch.testing.assert_close(out.last_hidden_state[real], expected.last_hidden_state[real], rtol=1e-5, atol=1e-5)
    assert torch.equal(out.last_hidden_state[~real], torch.zeros_like(out.last_hidden_state[~real]))
    assert len(out.hidden_states) == len(expected.hidden_states)
    for hidden, hidden_expected in zip(out.hidden_states, expected.hidden_states):
        torch.testing.assert_close(hidden[real], hidden_expected[real], rtol=1e-5, atol=1e-5)
    if getattr(out, "pooler_output", None) is not None:
        first_real = real[:, 0]  # ALBERT's pooler (Linear, tanh) reads position 0
        torch.testing.assert_close(out.pooler_output[first_real], expected.pooler_output[first_real])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_equal_under_every_policy(name, policy):
    padded, unpadded = (m.train() for m in _pair(name, recompute=policy))
    # every row starts with a token: a pooled head reads position 0 (a zero row where it is padding)
    ids, mask = _batch(padded.config, "right")
    results = []
    for model in (padded, unpadded):
        model.zero_grad()
        out = model(ids, attention_mask=mask)
        value = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
        real = value if value.shape[:2] != mask.shape else value[mask.bool()]  # per sequence, or per real token
        (real * torch.randn(real.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
        results.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    _assert_grads_close(results[1], results[0])


@pytest.mark.parametrize("name", sorted(BASE))
def test_kept_memory_scales_with_real_tokens(name):
    padded, unpadded = (m.train() for m in _pair(name, dropout=0.1))
    mask = torch.zeros(8, 32, dtype=torch.long)
    for row, length in enumerate((32, 4, 9, 16, 3, 20, 11, 7)):
        mask[row, :length] = 1
    ids = torch.randint(5, 100, mask.shape)
    kept = measure_activation_memory(unpadded, ids, attention_mask=mask).saved_bytes
    kept_padded = measure_activation_memory(padded, ids, attention_mask=mask).saved_bytes
    ratio = mask.sum().item() / mask.numel()
    assert kept <= 1.1 * ratio * kept_padded, (kept, kept_padded, ratio)


@pytest.mark.parametrize("name", sorted(BASE))
def test_calls_that_run_padded(name, monkeypatch):
    calls = _varlen_calls(monkeypatch)
    padded, unpadded = (m.eval() for m in _pair(name))
    ids, mask = _batch(padded.config)
    with torch.no_grad():
        expected = padded(ids, attention_mask=mask).last_hidden_state
        for kwargs in ({"output_attentions": True}, {"attention_mask": None}):
            out = unpadded(ids, **{"attention_mask": mask, **kwargs}).last_hidden_state
            if kwargs.get("attention_mask", mask) is not None:
                torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        unpadded.unpad = False
        torch.testing.assert_close(unpadded(ids, attention_mask=mask).last_hidden_state, expected)
    assert not calls
    if name not in POSITIONAL:  # their packed calls build no mask (and MPNet has eager attention only)
        # flex attention builds a BlockMask even for the packed row: the call runs padded
        flex = sf.patch(_model(name, attn="flex_attention"), unpad=True).eval()
        reason = flex.padded_reason({"attention_mask": mask}, {})
        assert reason == "the flex_attention attention implementation builds a mask for the packed row"


@pytest.mark.parametrize("name", sorted(BASE))
def test_summary_and_unpatch(name):
    _, unpadded = _pair(name)
    swaps = [swap.change for swap in sf.patch_summary(unpadded).class_swaps]
    assert swaps[-1] == "unpadded: packed real tokens, varlen attention"
    sf.unpatch(unpadded)
    assert type(unpadded).__name__ == name


@pytest.mark.parametrize("name", sorted(BASE))
def test_torch_compile_breaks_the_graph_once_at_the_packing_and_matches(name):
    counters = torch._dynamo.utils.counters
    _, unpadded = (m.eval() for m in _pair(name))
    ids, mask = _batch(unpadded.config, "left")
    counters.clear()
    compiled = torch.compile(unpadded, backend="eager")  # dynamo's tracing, no code generation
    results = []
    for run in (compiled, unpadded):
        unpadded.zero_grad(set_to_none=True)
        out = run(ids, attention_mask=mask).last_hidden_state
        out.square().sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in unpadded.parameters() if p.grad is not None]))
    # the packing keyword costs no break of its own: the graph breaks only at the packing's
    # token count (and MPNet's check for padding between tokens), host syncs both
    breaks = dict(counters["graph_break"])
    assert breaks and all(
        "pack_padding_mask" in reason or "has_padding_between_tokens" in reason for reason in breaks
    ), breaks
    assert sum(count for reason, count in breaks.items() if "pack_padding_mask" in reason) == 1, breaks
    (out, grads), (expected, expected_grads) = results
    torch.testing.assert_close(out, expected)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad)
    torch._dynamo.reset()
