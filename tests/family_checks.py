"""Checks every patched HF encoder family passes (DistilBERT, ALBERT, MPNet ...), shared by
their test files: fused embeddings, and dropout seeded by torch's generator."""

import copy

import torch
from torch import nn

from slimformer.kernels.philox import dropout_threshold
from slimformer.layers.norm import DropoutInNorm, LayerNormDropout
from slimformer.patch import patch
from tests.test_patch import _assert_grads_close, _loss_and_grads, _outputs


def _embeddings_grads(embeddings, ids, dy):
    embeddings.zero_grad()
    out = embeddings(input_ids=ids)
    (out * dy).sum().backward()
    return out, {name: p.grad.clone() for name, p in embeddings.named_parameters()}


def assert_embeddings_norm_and_dropout_run_as_one_kernel(make_model, ids, dy, norm="LayerNorm", dropout="dropout"):
    """``make_model(p)``: a base model with dropout p, whose embeddings call ``norm`` then
    ``dropout`` (attribute names). Without dropout, exactly HF's embeddings; with it, HF's
    computation with the mask the kernel drew (read from its output), which backward must
    regenerate."""
    for p in (0.0, 0.3):
        reference = make_model(p).train()
        model = patch(copy.deepcopy(reference))
        fused_norm = getattr(model.embeddings, norm)
        assert type(fused_norm) is LayerNormDropout and fused_norm.fuses_dropout()
        assert type(getattr(model.embeddings, dropout)) is DropoutInNorm
        out, grads = _embeddings_grads(model.embeddings, ids, dy)
        keep = out != 0
        if p:
            assert 0.5 < keep.float().mean() < 0.9  # ~0.7 kept
            setattr(reference.embeddings, dropout, nn.Identity())
            scale = dropout_threshold(p)[1]
            reference.embeddings.register_forward_hook(lambda m, a, y: torch.where(keep, y * scale, 0.0))
        expected_out, expected = _embeddings_grads(reference.embeddings, ids, dy)
        torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
        _assert_grads_close(grads, expected)


def assert_dropout_seeded_by_torch(reference, model, ids, mask):
    """``model`` (a patched copy of ``reference``, a classifier with dropout) in training:
    the same torch seed gives the same loss and gradients, another seed another loss; in
    eval both give the same logits."""
    model.train()
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.append(_loss_and_grads(model, ids, mask))
    (first, first_grads), (again, again_grads), (other, _) = runs
    assert torch.equal(first, again)  # the masks come from torch's seed, forward and backward
    assert all(torch.equal(first_grads[name], again_grads[name]) for name in first_grads)
    assert not torch.equal(first, other)  # dropout is on
    reference.eval()
    model.eval()
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits)


def spread_layer_norms(model: nn.Module) -> nn.Module:
    """LayerNorm weights and biases away from their initial 1 and 0, so that a mistake in
    either shows (in place; returns the model)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                if module.bias is not None:  # ModernBERT's have none
                    module.bias.uniform_(-0.5, 0.5)
    return model


def refuser(monkeypatch, *targets):
    """A function that makes each (class, method name) in ``targets`` raise once called:
    the fused forward must not need the originals."""

    def refuse():
        for owner, name in targets:

            def raising(*args, _name=f"{owner.__name__}.{name}", **kwargs):
                raise AssertionError(f"the original {_name} ran")

            monkeypatch.setattr(owner, name, raising)

    return refuse


def assert_eval_outputs_match(reference, model, ids, mask, refuse):
    """Every output of ``model`` (patched ``reference``, eval) equals the reference's, with
    padding and without (sdpa then hands the layers no mask), the originals refused."""
    with torch.no_grad():
        masks = (mask, torch.ones_like(mask))
        expected = [_outputs(reference, ids, m) for m in masks]
        refuse()
        for m, want in zip(masks, expected, strict=True):
            for out, value in zip(_outputs(model, ids, m), want, strict=True):
                torch.testing.assert_close(out, value, rtol=1e-5, atol=1e-5)


def assert_gradients_match(reference, model, ids, mask, refuse):
    """The loss and every parameter's gradient of ``model`` (patched ``reference``,
    training, no dropout) equal the reference's, the originals refused."""
    expected_loss, expected = _loss_and_grads(reference, ids, mask)
    refuse()
    loss, grads = _loss_and_grads(model, ids, mask)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    _assert_grads_close(grads, expected)


def assert_masked_lm_loss_fused(reference, model, ids, mask):
    """``model`` (patched ``reference``, a ``*ForMaskedLM`` in training, no dropout) returns
    HF's loss and gradients without logits, every third real token labelled; under
    ``torch.no_grad`` its own forward, logits and all."""
    labels = torch.full_like(ids, -100)
    labels[:, 1::3] = ids[:, 1::3]
    labels[mask == 0] = -100
    results = []
    for m in (model, reference):
        m.zero_grad()
        out = m(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        results.append((out, {name: p.grad for name, p in m.named_parameters()}))
    (out, grads), (expected_out, expected) = results
    assert out.logits is None and expected_out.logits is not None
    torch.testing.assert_close(out.loss, expected_out.loss, rtol=1e-5, atol=1e-6)
    _assert_grads_close(grads, expected)
    with torch.no_grad():  # no grad, or eval: the model's own forward, logits and all
        torch.testing.assert_close(
            model(ids, attention_mask=mask, labels=labels).logits, reference(ids, attention_mask=mask).logits
        )
