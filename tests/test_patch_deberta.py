"""slimformer.patch of HuggingFace DeBERTa-v2/-v3: fused layers whose disentangled attention
(c2p and p2c) runs in one kernel, equal to HF's, keeping nothing quadratic.

Tiny models from configs (no downloads), on the PyTorch path (TRITON_INTERPRET=0) unless a
test says otherwise."""

import copy
import io

import pytest
import torch
from transformers import (
    DebertaV2Config,
    DebertaV2ForMaskedLM,
    DebertaV2ForQuestionAnswering,
    DebertaV2ForSequenceClassification,
    DebertaV2ForTokenClassification,
    DebertaV2Model,
)
from transformers.models.deberta_v2 import modeling_deberta_v2 as hf

import slimformer as sf
from slimformer.integrations.hf.deberta import FusedDebertaV2LayerMixin, PaddingMask, RelativePositions
from slimformer.kernels.attention.disentangled import relative_position_index
from slimformer.memory import measure_activation_memory
from slimformer.patch import patch, patch_summary, unpatch
from slimformer.recompute import POLICIES
from tests.family_checks import (
    assert_dropout_seeded_by_torch,
    assert_eval_outputs_match,
    assert_masked_lm_loss_fused,
    refuser,
    spread_layer_norms,
)
from tests.test_patch import _assert_grads_close, _batch, _loss_and_grads

MODELS = {
    "DebertaV2Model": DebertaV2Model,
    "DebertaV2ForSequenceClassification": DebertaV2ForSequenceClassification,
    "DebertaV2ForMaskedLM": DebertaV2ForMaskedLM,
    "DebertaV2ForTokenClassification": DebertaV2ForTokenClassification,
    "DebertaV2ForQuestionAnswering": DebertaV2ForQuestionAnswering,
}
# DeBERTa-v3's attention settings, tiny: log buckets (4 · 2 rows of positions, fewer than the
# sequence's 2 · 11 − 1 distances, so the buckets clamp), shared keys, both terms, normed positions.
V3 = dict(
    relative_attention=True,
    position_buckets=4,
    max_relative_positions=16,
    pos_att_type=["p2c", "c2p"],
    share_att_key=True,
    norm_rel_ebd="layer_norm",
    position_biased_input=False,
)
TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
# transformers' own test config: no relative attention, and "none" for the position terms.
PLAIN = dict(relative_attention=False, pos_att_type="none", position_biased_input=True)
# The variants of the attention the kernel must equal: v2's separate position projections, one
# term alone, unbucketed positions, no relative attention (terms named, which count in the
# scale, or "none"), v2-xlarge's conv layer.
VARIANTS = {
    "v3": {},
    "v2-separate-projections": dict(share_att_key=False),
    "c2p-only": dict(pos_att_type=["c2p"], share_att_key=False),
    "p2c-only": dict(pos_att_type=["p2c"]),
    "unbucketed": dict(position_buckets=-1, max_relative_positions=6),
    "no-relative-attention": dict(relative_attention=False, position_biased_input=True),
    "plain-attention": PLAIN,
    "conv-layer": dict(conv_kernel_size=3, norm_rel_ebd="none"),
}


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _config(dropout=0.1, **overrides):
    return DebertaV2Config(
        **{**TINY, **V3, **overrides}, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout
    )


def _model(name="DebertaV2Model", dropout=0.1, **overrides):
    torch.manual_seed(0)
    model = spread_layer_norms(MODELS[name](_config(dropout, **overrides)))
    with torch.no_grad():  # position embeddings away from their initial values
        encoder = model.base_model.encoder
        if encoder.relative_attention:
            encoder.rel_embeddings.weight.normal_()
    return model


@pytest.fixture
def original_refused(monkeypatch):
    """DeBERTa's layer and attention forwards and HF's (seq, seq) mask and positions raise once called."""
    return refuser(
        monkeypatch,
        (hf.DebertaV2Layer, "forward"),
        (hf.DisentangledSelfAttention, "forward"),
        (hf.DebertaV2Encoder, "get_attention_mask"),
        (hf.DebertaV2Encoder, "get_rel_pos"),
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_eval_outputs_match_with_padding(name, original_refused):
    # every output position, padding included: HF's padded queries weigh every key alike
    reference = _model(name).eval()
    model = patch(copy.deepcopy(reference))
    assert all(isinstance(layer, FusedDebertaV2LayerMixin) for layer in model.base_model.encoder.layer)
    assert_eval_outputs_match(reference, model, *_batch(model.config), original_refused)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gradients_match_the_position_embeddings_included(variant, original_refused):
    reference = _model("DebertaV2ForSequenceClassification", dropout=0.0, **VARIANTS[variant]).train()
    model = patch(copy.deepcopy(reference))
    ids, mask = _batch(model.config)
    expected_loss, expected = _loss_and_grads(reference, ids, mask)
    original_refused()
    loss, grads = _loss_and_grads(model, ids, mask)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    if model.config.relative_attention:
        assert grads["deberta.encoder.rel_embeddings.weight"].abs().max() > 0
    unused = {name for name, grad in expected.items() if grad is None}  # e.g. the positions' norm without them
    assert unused == {name for name, grad in grads.items() if grad is None}
    _assert_grads_close(*({k: v for k, v in g.items() if k not in unused} for g in (grads, expected)))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_reference_gradients(policy, original_refused):
    reference = _model("DebertaV2ForSequenceClassification", dropout=0.0).train()
    model = patch(copy.deepcopy(reference), recompute=policy)
    ids, mask = _batch(model.config)
    expected = _loss_and_grads(reference, ids, mask)[1]
    original_refused()
    _assert_grads_close(_loss_and_grads(model, ids, mask)[1], expected)


@pytest.mark.parametrize("seq", [1, 7, 40])
@pytest.mark.parametrize(("buckets", "max_positions"), [(4, 16), (256, 512), (-1, 6)])
def test_the_kernels_positions_are_hfs(seq, buckets, max_positions):
    # HF's c2p index clamp(rel(i, j) + span) and p2c index clamp(-rel(j, i) + span) are one table
    span = buckets if buckets > 0 else max_positions
    x = torch.zeros(1, seq, 4)
    relative = hf.build_relative_position(x, x, bucket_size=buckets, max_position=max_positions)[0]
    index = relative_position_index(seq, seq, span, buckets, max_positions, "cpu").long()
    rows, cols = torch.meshgrid(torch.arange(seq), torch.arange(seq), indexing="ij")
    gathered = index[rows - cols + seq - 1]
    assert torch.equal(gathered, torch.clamp(relative + span, 0, 2 * span - 1))
    assert torch.equal(gathered, torch.clamp(-relative.T + span, 0, 2 * span - 1))


def test_the_encoder_hands_markers_that_materialize_to_hfs_tensors():
    model = patch(_model("DebertaV2Model"))
    encoder = model.encoder
    ids, mask = _batch(model.config)
    x = torch.zeros(*ids.shape, TINY["hidden_size"])
    marker, positions = encoder.get_attention_mask(mask), encoder.get_rel_pos(x)
    assert isinstance(marker, PaddingMask) and isinstance(positions, RelativePositions)
    assert torch.equal(marker.materialize(), hf.DebertaV2Encoder.get_attention_mask(encoder, mask))
    assert torch.equal(positions.materialize(), hf.DebertaV2Encoder.get_rel_pos(encoder, x))
    three_d = mask[:, None, :] * mask[:, :, None]  # a (batch, seq, seq) mask stays HF's tensor
    assert torch.equal(encoder.get_attention_mask(three_d), hf.DebertaV2Encoder.get_attention_mask(encoder, three_d))


def test_a_three_d_mask_runs_the_original_layers():
    # DebertaV2Model's embeddings take only (batch, seq) masks; its encoder takes (batch, seq, seq)
    reference = _model("DebertaV2Model").eval()
    model = patch(copy.deepcopy(reference))
    ids, mask = _batch(model.config)
    pairs = mask[:, None, :] * mask[:, :, None]
    with torch.no_grad():
        x = reference.embeddings(ids, mask=mask)
        torch.testing.assert_close(model.encoder(x, pairs)[0], reference.encoder(x, pairs)[0])


def test_keeps_nothing_quadratic():
    # HF keeps (batch, heads, seq, seq) c2p and p2c products, scores, probabilities and dropout
    # masks; patched, the largest tensor kept for backward grows linearly in seq
    largest = {}
    for seq in (64, 128):
        model = patch(_model("DebertaV2Model", position_buckets=64, max_relative_positions=256)).train()
        ids = torch.randint(5, 100, (2, seq))
        memory = measure_activation_memory(lambda m=model, i=ids: m(i).last_hidden_state, exclude=model.parameters())
        largest[seq] = max(record.nbytes for record in memory.saved)
    assert largest[128] <= 2 * largest[64], largest


@pytest.mark.parametrize("policy", ["none", "qkv+mlp"])
def test_dropout_is_seeded_by_torch(policy):
    reference = _model("DebertaV2ForSequenceClassification", dropout=0.1)
    model = patch(copy.deepcopy(reference), recompute=policy)
    assert_dropout_seeded_by_torch(reference, model, *_batch(model.config))


@pytest.mark.parametrize("legacy", [True, False], ids=["cls-predictions", "lm-predictions"])
def test_masked_lm_loss_is_fused(legacy):
    reference = _model("DebertaV2ForMaskedLM", dropout=0.0, legacy=legacy).train()
    model = patch(copy.deepcopy(reference), recompute="qkv+mlp")
    assert type(model).__name__ == "FusedDebertaV2ForMaskedLM"
    assert_masked_lm_loss_fused(reference, model, *_batch(model.config))


def test_attentions_and_query_states_run_the_original_layers():
    reference = _model("DebertaV2Model", dropout=0.0).eval()
    model = patch(copy.deepcopy(reference))
    ids, mask = _batch(model.config)
    with torch.no_grad():
        out, expected = (m(ids, attention_mask=mask, output_attentions=True) for m in (model, reference))
        assert len(out.attentions) == len(expected.attentions) == 2
        for got, want in zip(
            (*out.attentions, out.last_hidden_state), (*expected.attentions, expected.last_hidden_state)
        ):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the enhanced mask decoder's steps pass query_states (HF's own z_steps loop fails in transformers 5)
    encoder, hf_encoder = model.encoder, reference.encoder
    x = reference.embeddings(ids, mask=mask)
    args = (x, hf_encoder.get_attention_mask(mask))
    extra = dict(
        query_states=x.flip(1), relative_pos=hf_encoder.get_rel_pos(x), rel_embeddings=encoder.get_rel_embedding()
    )
    with torch.no_grad():
        torch.testing.assert_close(encoder.layer[1](*args, **extra)[0], hf_encoder.layer[1](*args, **extra)[0])


def test_summary_unpatch_and_pickle():
    model = _model("DebertaV2ForSequenceClassification")
    keys = list(model.state_dict())
    patch(model)
    assert list(model.state_dict()) == keys
    changes = [swap.change for swap in patch_summary(model).class_swaps]
    assert changes == ["padding mask and relative positions handed to the fused disentangled attention"]
    ids, mask = _batch(model.config)
    buffer = io.BytesIO()
    torch.save(model.eval(), buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    unpatch(model)
    assert type(model.deberta.encoder).__name__ == "DebertaV2Encoder"
    assert type(model.deberta.encoder.layer[0]).__name__ == "DebertaV2Layer"


def _unpadded_gradients_match(name, ids, mask, refuse=lambda: None, **config):
    # every real token's output and every parameter's gradient, as the padded HF model gives them
    reference = _model(name, dropout=0.0, **config).train()
    model = patch(copy.deepcopy(reference), unpad=True)
    assert type(model.base_model).__name__ == "UnpaddedDebertaV2Model"
    real = mask.bool()
    results = []
    for m in (reference, model):
        if m is model:
            refuse()
        m.zero_grad()
        out = m(ids, attention_mask=mask, output_hidden_states=True)
        hidden = out.hidden_states[-1]
        grad = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(3)) * real[..., None]
        (hidden * grad).sum().backward()
        results.append((hidden[real], [h[real] for h in out.hidden_states], dict(m.named_parameters())))
    (want, want_states, expected), (got, got_states, params) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_states, want_states, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    grads = {k: p.grad for k, p in params.items() if expected[k].grad is not None}
    _assert_grads_close(grads, {k: p.grad for k, p in expected.items() if p.grad is not None})


@pytest.mark.parametrize("variant", ["v3", "c2p-only", "unbucketed", "plain-attention"])
def test_unpadded_model_matches_hfs_at_the_real_tokens(variant, original_refused):
    ids, mask = _batch(_config())
    _unpadded_gradients_match("DebertaV2ForTokenClassification", ids, mask, original_refused, **VARIANTS[variant])


def test_unpadded_model_on_the_kernels_too(backend):
    _unpadded_gradients_match("DebertaV2Model", *_batch(_config()))


def test_unpad_runs_padded_where_positions_would_move():
    # padding between two tokens (the padded model's relative positions count it), and v2-xlarge's conv layer
    for config, mask_row in ((dict(), [1, 1, 0, 1, 1, 1, 0, 0]), (dict(conv_kernel_size=3), [1] * 5 + [0] * 3)):
        reference = _model("DebertaV2Model", dropout=0.0, **config).eval()
        model = patch(copy.deepcopy(reference), unpad=True)
        ids = torch.randint(5, 100, (2, 8), generator=torch.Generator().manual_seed(0))
        mask = torch.tensor([mask_row, [1] * 8])
        with torch.no_grad():
            got, want = (
                model(ids, attention_mask=mask).last_hidden_state,
                reference(ids, attention_mask=mask).last_hidden_state,
            )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the padded forward: every position


def test_unsupported_attention_is_left_with_the_reason():
    model = _model("DebertaV2Model", pos_att_type=["c2p", "p2p"])
    patch(model)
    left = {item.name: item.reason for item in patch_summary(model).left}
    assert "pos_att_type ['p2p'] has no fused kernel" in left["encoder.layer.0"]
    assert type(model.encoder.layer[0]) is hf.DebertaV2Layer
    assert "its layers are not all fused" in left["encoder"]

    class LookAlike(hf.DebertaV2Layer):
        pass

    model = _model("DebertaV2Model")
    model.encoder.layer[0] = LookAlike(model.config)
    patch(model)
    left = {item.name: item.reason for item in patch_summary(model).left}
    assert "not a DeBERTa-v2 layer verified" in left["encoder.layer.0"]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(
    "pos_att_type", ["none", None, ["c2p", "p2c"], ["p2p"]], ids=["none", "None", "c2p-p2c", "p2p"]
)
def test_plain_attention_layers_fuse(name, pos_att_type, original_refused):
    # without relative attention HF computes no position term, whatever pos_att_type names
    reference = _model(name, **{**PLAIN, "pos_att_type": pos_att_type}).eval()
    keys = list(reference.state_dict())
    model = patch(copy.deepcopy(reference))
    assert not [item.name for item in patch_summary(model).left if ".encoder" in f".{item.name}"]
    assert all(isinstance(layer, FusedDebertaV2LayerMixin) for layer in model.base_model.encoder.layer)
    assert list(model.state_dict()) == keys
    assert_eval_outputs_match(reference, model, *_batch(model.config), original_refused)
    unpatch(model)
    assert type(model.base_model.encoder) is hf.DebertaV2Encoder
    assert all(type(layer) is hf.DebertaV2Layer for layer in model.base_model.encoder.layer)
    assert list(model.state_dict()) == keys


@pytest.mark.parametrize("config", [{}, PLAIN], ids=["v3", "plain-attention"])
def test_int8_quantized_patched_model_stays_close(config):
    reference = _model("DebertaV2ForSequenceClassification", **config).eval()
    model = sf.quantize(patch(copy.deepcopy(reference)), "int8")
    assert all(isinstance(layer, FusedDebertaV2LayerMixin) for layer in model.deberta.encoder.layer)
    ids, mask = _batch(model.config)
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99


def test_bf16_autocast_training_matches_hfs():
    reference = _model("DebertaV2ForSequenceClassification", dropout=0.0).train()
    model = patch(copy.deepcopy(reference))
    ids, mask = _batch(model.config)
    grads = []
    for m in (model, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            grads.append(_loss_and_grads(m, ids, mask)[1])
    exact = _loss_and_grads(reference, ids, mask)[1]
    # bf16 vs fp32: no worse than 2x HF's own bf16 error on the largest gradient
    for name, value in exact.items():
        ours = (grads[0][name].float() - value).abs().max()
        theirs = (grads[1][name].float() - value).abs().max()
        assert ours <= 2 * theirs + 1e-2 * value.abs().max() + 1e-6, name


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "unpad"])
def test_torch_compile_of_the_patched_model_gives_hfs_gradients(unpad):
    # the ops' fake kernels must give the real ops' strides: q, k, v arrive as head views
    reference = _model("DebertaV2ForSequenceClassification", dropout=0.0).train()
    model = patch(copy.deepcopy(reference), unpad=unpad)
    ids, mask = _batch(model.config)
    compiled = torch.compile(model, backend="aot_eager")
    compiled.zero_grad()
    loss = compiled(ids, attention_mask=mask).logits.sum()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    reference.zero_grad()
    reference(ids, attention_mask=mask).logits.sum().backward()
    _assert_grads_close(grads, {name: p.grad for name, p in reference.named_parameters()})


def test_gradients_match_on_the_kernels_too(backend):
    # the interpreted kernels gather the tiles' position rows and read them off the skews
    reference = _model("DebertaV2Model", dropout=0.0).train()
    model = patch(copy.deepcopy(reference), recompute="qkv")
    ids, mask = _batch(model.config)
    expected_loss, expected = _loss_and_grads(reference, ids, mask)
    loss, grads = _loss_and_grads(model, ids, mask)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    _assert_grads_close(grads, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["DebertaV2ForSequenceClassification", "DebertaV2ForMaskedLM"])
def test_gradients_match_on_gpu(name, monkeypatch):
    # fp32 on the compiled kernels: HF's loss and gradients, every output position included
    reference = _model(name, dropout=0.0, position_buckets=64, max_relative_positions=256).cuda().train()
    model = patch(copy.deepcopy(reference), recompute="qkv")
    ids, mask = (t.cuda() for t in _batch(model.config, batch=3, seq=200))
    # HF's fp32 bmm in full fp32, as the kernels' ieee dots
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    expected_loss, expected = _loss_and_grads(reference, ids, mask)
    loss, grads = _loss_and_grads(model, ids, mask)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-4, atol=1e-4)
    _assert_grads_close(grads, expected, rtol=1e-3, atol=1e-4)
