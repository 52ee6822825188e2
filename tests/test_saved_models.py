"""Models pickled whole by an earlier slimformer still load and compute the same.

tests/data/models-before-architecture.pt was written by tests/data/save_models.py at the
commit before issue 25 moved modules (patched BERT masked-LM with recompute, unpadded and
quantized classifiers, a patched torch encoder and Llama RMSNorms): ``torch.load`` finds
their classes and rebuild functions by the module paths of that time.
"""

from pathlib import Path

import pytest
import torch

import slimformer as sf
from tests.data.save_models import first_output

SAVED = torch.load(Path(__file__).parent / "data" / "models-before-architecture.pt", weights_only=False)


@pytest.fixture(autouse=True)
def torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _with_the_installed_transformers_instance_state(model):
    """Llama attention pickled before transformers' ``kernels`` integration lacks the
    ``_kernel_funcs`` that the integration's wrapped ``__init__`` now sets per instance
    (``torch.load`` runs no ``__init__``): that is transformers' state, not slimformer's, so it
    is copied from an attention module built anew from the model's config."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    for module in model.modules():
        if isinstance(module, LlamaAttention) and "_kernel_funcs" not in vars(module):
            fresh = LlamaAttention(model.config, module.layer_idx)
            if "_kernel_funcs" in vars(fresh):
                module._kernel_funcs = fresh._kernel_funcs
    return model


@pytest.mark.parametrize("name", sorted(SAVED))
def test_saved_model_loads_and_computes_the_same(name):
    saved = SAVED[name]
    model = _with_the_installed_transformers_instance_state(saved["model"])
    with torch.no_grad():
        output = first_output(model(**saved["inputs"]))
    torch.testing.assert_close(output, saved["output"])
    if "quantized" not in name:
        assert sf.patch_summary(model).swapped
        sf.unpatch(model)
        assert not any(type(m).__module__.startswith("slimformer") for m in model.modules())


def test_names_that_moved_import_from_their_earlier_modules():
    from slimformer.kernels.norm import MEMORY_MODES, MemoryModes
    from slimformer.kernels.varlen_attention import varlen_attention
    from slimformer.layers import memory_modes, policies
    from slimformer.recompute import POLICIES, check_policy

    assert (MemoryModes, MEMORY_MODES) == (memory_modes.MemoryModes, memory_modes.MEMORY_MODES)
    assert varlen_attention is sf.varlen_attention
    assert (POLICIES, check_policy) == (policies.POLICIES, policies.check_policy)
