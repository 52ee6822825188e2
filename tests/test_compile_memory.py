"""torch.compile keeps slimformer's savings: a patched BERT compiled with fullgraph saves
for backward no more than it saves in eager mode, under every recompute policy, and
draws the same dropout masks (same outputs and gradients).

One small BERT with dropout 0.1; each compiled model is built once for the module.
Every policy goes through ``aot_eager_decomp_partition`` (AOTAutograd with inductor's
decompositions and its min-cut partitioner, which is what decides what is saved, without
generating code); ``qkv+mlp`` also through inductor itself. ``fallback_random`` makes
inductor draw HF's own embedding dropout from torch's generator as eager does;
slimformer's seeds come from it in any case.
"""

import copy

import pytest
import torch

from slimformer.patch import patch
from slimformer.recompute import POLICIES

transformers = pytest.importorskip("transformers")
# one worker builds the compiled models (``compiled_pairs``) for every test of the module
pytestmark = pytest.mark.xdist_group("compile-memory")

BATCH, SEQ = 2, 64


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=256,
        vocab_size=64,
        max_position_embeddings=SEQ,
    )
    model = transformers.BertModel(config).train()
    model.set_attn_implementation("eager")
    return model


@pytest.fixture(scope="module")
def inputs():
    return {"input_ids": torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))}


CASES = [(policy, "aot_eager_decomp_partition") for policy in POLICIES] + [("qkv+mlp", "inductor")]


def _hooks(pack=lambda tensor: tensor):
    # every compiled call runs under saved-tensor hooks, which dynamo guards on
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


@pytest.fixture(scope="module")
def compiled_pairs(bert, inputs):
    """(policy, backend) -> (eager patched model, its compiled twin), compiled on their first step."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "0")  # the CPU path: the PyTorch references inside the ops
    pairs = {}
    # one recompile of the shared BERT code objects per model instance
    with torch._inductor.config.patch(fallback_random=True), torch._dynamo.config.patch(recompile_limit=64):
        for policy, backend in CASES:
            model = patch(copy.deepcopy(bert), recompute=policy)
            compiled = torch.compile(model, fullgraph=True, backend=backend)
            with _hooks():
                compiled(**inputs).last_hidden_state.sum().backward()
            pairs[policy, backend] = model, compiled
        yield pairs
    mp.undo()


def _saved_bytes(model, parameters, inputs, generator_states=True) -> int:
    """Bytes of the distinct storages autograd saves in one forward, parameters (and CPU
    generator states, unless ``generator_states``) left out."""
    storages = {}
    state_bytes = torch.get_rng_state().numel()

    def pack(tensor):
        storage = tensor.untyped_storage()
        if generator_states or tensor.dtype != torch.uint8 or storage.nbytes() != state_bytes:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with _hooks(pack):
        out = model(**inputs)
    skip = {p.untyped_storage().data_ptr() for p in parameters}
    del out
    return sum(n for ptr, n in storages.items() if ptr not in skip)


@pytest.mark.parametrize("policy, backend", CASES)
def test_compiled_keeps_no_more_than_eager(compiled_pairs, inputs, policy, backend):
    model, compiled = compiled_pairs[policy, backend]
    parameters = list(model.parameters())
    eager = _saved_bytes(model, parameters, inputs)
    kept = _saved_bytes(compiled, parameters, inputs)
    # AOTAutograd re-planning what the ops save would keep several times eager's bytes;
    # it may keep less (it recomputes cheap aten ops outside the ops, such as HF's masks)
    assert kept <= 1.10 * eager, f"{policy}: compiled saves {kept} B, eager {eager} B"


@pytest.mark.parametrize("policy, backend", CASES)
def test_compiled_step_matches_eager_with_dropout(compiled_pairs, inputs, policy, backend):
    model, compiled = compiled_pairs[policy, backend]
    results = []
    with _hooks():
        for run in (model, compiled):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(5)
            out = run(**inputs).last_hidden_state
            (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
            # the compiled graph gives the pooler, which the loss does not use, zero gradients
            grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
            results.append((out.detach(), grads))
    (out, grads), (out_compiled, grads_compiled) = results
    # different dropout masks would differ by O(1); inductor's fused aten ops round differently
    torch.testing.assert_close(out_compiled, out, rtol=1e-5, atol=1e-5)
    for g_compiled, g in zip(grads_compiled, grads):
        torch.testing.assert_close(g_compiled, g, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["bert", "transformer-post-ln"])
def test_full_keeps_every_layer_input_under_compile(bert, inputs, kind, monkeypatch):
    # `full` keeps each layer's input and recomputes one layer at a time. A checkpoint
    # region ending in a multi-output op (the last norm) lost its saved boundary under the
    # partitioner, which then kept only the first layer's input and recomputed every
    # layer at the start of backward (compiled peak = the `none` policy's): two layers
    # tell the two apart.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(0)
    if kind == "bert":
        model = copy.deepcopy(bert)
        model.encoder.layer.append(copy.deepcopy(model.encoder.layer[0]))
        model.config.num_hidden_layers = 2
    else:
        layer = torch.nn.TransformerEncoderLayer(32, 2, 64, 0.1, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).train()
        inputs = {"src": torch.randn(BATCH, SEQ, 32)}
    model = patch(model, recompute="full")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager_decomp_partition")
    with _hooks():
        compiled(**inputs)  # compiles
    # compiled, each dropout seed drawn in the region is recomputed from a saved copy of
    # the CPU generator's state (5 KiB; eager's checkpoint keeps one per region outside
    # autograd's saved tensors): left out here, next to the layer inputs of a real size
    parameters = list(model.parameters())
    eager = _saved_bytes(model, parameters, inputs)
    kept = _saved_bytes(compiled, parameters, inputs, generator_states=False)
    assert 0.9 * eager <= kept <= 1.1 * eager, f"{kind}: compiled saves {kept} B, eager {eager} B"
