"""ModernBERT encoders of HuggingFace transformers (>= 5): the GeGLU MLP on the fused MLP kernel.

``ModernBertMLP`` computes ``Wo(drop(act(input) * gate))`` with ``input, gate =
Wi(x).chunk(2)``: the fused MLP's ``geglu`` (``slimformer.kernels.activation``), which keeps
only Wi's output for backward, or nothing at the ``mlp`` recompute policies, where HF keeps
Wi's output, the activation, the product and the dropout mask. ``FusedModernBertMLP``
subclasses the MLP's class and shares its submodules (``state_dict``, hooks and ``unpatch``
as for the other families); its ``recompute`` is the layer policy (``mlp``, ``qkv+mlp`` and
``full`` recompute fc1; the others keep it). Its LayerNorms are ``torch.nn.LayerNorm`` and
become ``slimformer.LayerNorm`` as everywhere.

The MLP calls its original forward, for that call, when Wi, Wo, the activation or the
dropout has hooks or was replaced by another type (``sf.quantize``'s Linears included).

The embeddings' ``norm`` and ``drop``, which their forward calls as ``self.drop(self.norm(x))``
and nowhere else (source checked), become one fused norm kernel as BERT's do.

Not fused yet, so left with the reason in the summary: the attention (RoPE applied inside
the attention and the local layers' sliding window are not in the kernels yet; with
``model.set_attn_implementation("slimformer")`` its core runs on the fused kernel, reading
the local layers' window as a mask) and unpadding; an activation other than exact gelu.
"""

import inspect
import re

from torch import nn

from slimformer.integrations import ModelFamily
from slimformer.integrations.hf.classes import RuntimeMixin
from slimformer.kernels.activation import fused_mlp
from slimformer.layers.norm import fuse_with_dropout
from slimformer.layers.policies import check_policy
from slimformer.layers.sharing import NotScriptable, TorchDropout, TorchLayerNorm, has_user_hooks

__all__ = ["FAMILY", "FusedModernBertMLPMixin"]

_MODULE = "transformers.models.modernbert.modeling_modernbert"
_MLP = (_MODULE, "ModernBertMLP")
_EMBEDDINGS = (_MODULE, "ModernBertEmbeddings")
_DROP_OF_NORM = re.compile(r"self\.drop\(self\.norm\(")
_BASE_MODEL = (_MODULE, "ModernBertModel")
# transformers' exact GELU (``ACT2CLS["gelu"]``): the fused kernel's geglu
_GELU = "GELUActivation"


class FusedModernBertMLPMixin(RuntimeMixin, NotScriptable):
    """Forward of a patched ``ModernBertMLP`` (see the module docstring), mixed before its
    class; ``patch`` makes ``FusedModernBertMLP(FusedModernBertMLPMixin, ModernBertMLP)``."""

    def forward(self, hidden_states):
        if self._unfused_reason() is not None:
            return super().forward(hidden_states)
        policy = check_policy(self.recompute)
        dropout_p = self.drop.p if self.drop.training else 0.0
        return fused_mlp(
            hidden_states,
            self.Wi.weight,
            self.Wi.bias,
            self.Wo.weight,
            self.Wo.bias,
            "geglu",
            dropout_p,
            recompute_fc1="mlp" in policy or policy == "full",
        )

    def _unfused_reason(self) -> str | None:
        """Why this call runs the original forward (hooks, replaced submodules), or None."""
        for name, types in (("Wi", (nn.Linear,)), ("Wo", (nn.Linear,)), ("drop", (TorchDropout,)), ("act", None)):
            module = getattr(self, name)
            if types is not None and type(module) not in types:
                return f"{name} is a {type(module).__name__}"
            if has_user_hooks(module):
                return f"{name} has hooks"
        return None

    def extra_repr(self) -> str:
        return f"activation='geglu', recompute={self.recompute!r}"


def _mlp_problem(mlp: nn.Module) -> str | None:
    if type(mlp.act).__name__ != _GELU:
        return f"its activation is a {type(mlp.act).__name__}; the fused kernel's geglu is the exact gelu"
    for name in ("Wi", "Wo"):
        if type(getattr(mlp, name)) is not nn.Linear:
            return f"{name} is a {type(getattr(mlp, name)).__name__}, not torch.nn.Linear"
    if type(mlp.drop) is not TorchDropout:
        return f"drop is a {type(mlp.drop).__name__}, not torch.nn.Dropout"
    return None


def _fused_mlp(mlp: nn.Module) -> nn.Module:
    fused_class = FusedModernBertMLPMixin.over(type(mlp))
    fused = fused_class.__new__(fused_class)
    fused.__dict__.update({k: v.copy() if isinstance(v, (dict, set)) else v for k, v in mlp.__dict__.items()})
    fused.recompute = "none"
    return fused


def _replacement(module: nn.Module) -> tuple[nn.Module | None, str | None] | None:
    if (type(module).__module__, type(module).__name__) != _MLP:
        return None
    problem = _mlp_problem(module)
    return (None, problem) if problem else (_fused_mlp(module), None)


def _embeddings_problem(embeddings: nn.Module) -> str | None:
    try:
        source = inspect.getsource(type(embeddings).forward)
    except (OSError, TypeError):
        source = ""
    calls = len(_DROP_OF_NORM.findall(source))
    if not calls or not source.count("self.norm") == source.count("self.drop") == calls:
        return "its forward does not apply drop right after each norm (source checked)"
    for name, expected in (("norm", TorchLayerNorm), ("drop", TorchDropout)):
        if type(getattr(embeddings, name)) is not expected:
            return f"{name} is a {type(getattr(embeddings, name)).__name__}, not torch.nn.{expected.__name__}"
    return None


def _fused_embeddings(embeddings: nn.Module) -> tuple[dict[str, nn.Module], str | None] | None:
    """{"norm": LayerNormDropout, "drop": DropoutInNorm} of ModernBERT's embeddings, or ({}, why not)."""
    if (type(embeddings).__module__, type(embeddings).__name__) != _EMBEDDINGS:
        return None
    problem = _embeddings_problem(embeddings)
    if problem is not None:
        return {}, problem
    norm, drop = fuse_with_dropout(embeddings.norm, embeddings.drop)
    return {"norm": norm, "drop": drop}, None


def _unpadded(model: nn.Module) -> tuple[type | None, str | None] | None:
    kind = getattr(type(model), "_original_class", type(model))
    if (kind.__module__, kind.__name__) != _BASE_MODEL:
        return None
    return None, "unpad: not supported for ModernBERT yet (its attention is not fused); it runs padded"


FAMILY = ModelFamily("ModernBERT", _replacement, replace_children=_fused_embeddings, unpad=_unpadded)
