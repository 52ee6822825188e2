"""HuggingFace RMSNorms whose forward is LlamaRMSNorm's: one fused normalisation, then the weight.

transformers' LlamaRMSNorm, which Llama, Mistral, Qwen2/3 and about 130 more families in
transformers 5 copy verbatim, normalises in fp32, casts to the input's dtype and then
multiplies by the weight. A norm of any class (named ``*Norm*``, with a
``variance_epsilon``) whose forward has exactly that source, one 1-d ``weight`` and
nothing else becomes ``Fused<Norm>``, a subclass of its own class; any other is left
with the reason (Gemma's ``(1 + weight)``, T5's cast to the weight's dtype ...).
"""

import inspect
import textwrap

import torch
from torch import nn

from slimformer.integrations import ModelFamily
from slimformer.integrations.hf.classes import RuntimeMixin
from slimformer.kernels.norm import rms_norm

__all__ = ["FAMILY", "FusedLlamaStyleRMSNorm"]

# The forward of transformers' LlamaRMSNorm, which most decoder families copy verbatim.
_LLAMA_RMSNORM_FORWARD = """\
def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""
_NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FusedLlamaStyleRMSNorm(RuntimeMixin):
    """Forward of a patched HuggingFace RMSNorm whose forward is LlamaRMSNorm's.

    That forward normalises in fp32, casts to the input's dtype and then multiplies by
    the weight (in the dtype promotion of weight and input). Here the normalisation is
    one ``rms_norm`` call without weight (fp32 statistics, rounded once to the input's
    dtype, keeping its output and rstd for backward instead of an fp32 copy of the
    input), followed by the same ``weight *`` product. Inputs of other dtypes (float64)
    run the original forward.
    """

    def forward(self, hidden_states):
        if hidden_states.dtype not in _NORM_DTYPES:
            return super().forward(hidden_states)
        normalized = rms_norm(
            hidden_states, tuple(self.weight.shape), None, self.variance_epsilon, memory_efficient=True
        )
        return self.weight * normalized


_LLAMA_STYLE: dict[type, str | None] = {}


def _llama_style_rmsnorm_problem(norm: nn.Module) -> str | None:
    """Why ``norm`` (a module with a ``variance_epsilon``) is not a LlamaRMSNorm in all
    but name, or None."""
    kind = type(norm)
    if kind not in _LLAMA_STYLE:
        try:
            source = textwrap.dedent(inspect.getsource(kind.forward))
        except (OSError, TypeError):
            source = None
        same = source == _LLAMA_RMSNORM_FORWARD
        _LLAMA_STYLE[kind] = None if same else "its forward is not LlamaRMSNorm's (checked against its source)"
    if _LLAMA_STYLE[kind] is not None:
        return _LLAMA_STYLE[kind]
    parameters = dict(norm.named_parameters(recurse=False))
    extra = list(norm.children()) or list(norm.buffers())
    if list(parameters) != ["weight"] or parameters["weight"].dim() != 1 or extra:
        return "holds more than LlamaRMSNorm's one 1-d weight"
    if not isinstance(norm.variance_epsilon, float):
        return f"variance_epsilon is a {type(norm.variance_epsilon).__name__}, not a float"
    return None


def _fuse_llama_style_rmsnorm(norm: nn.Module) -> nn.Module:
    return FusedLlamaStyleRMSNorm.sharing(norm)


def _replacement(module: nn.Module) -> tuple[nn.Module | None, str | None] | None:
    if "Norm" not in type(module).__name__ or not hasattr(module, "variance_epsilon"):
        return None
    problem = _llama_style_rmsnorm_problem(module)
    return (None, problem) if problem else (_fuse_llama_style_rmsnorm(module), None)


FAMILY = ModelFamily("Llama-style RMSNorm", _replacement)
