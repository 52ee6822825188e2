"""Swap slimformer's fused layers into an existing model, in place, and back.

``patch(model)`` replaces modules one instance at a time, over the same Parameter
objects (no copies, the same ``state_dict`` keys and tensors, optimizers built before
the patch keep working):

* ``torch.nn.TransformerEncoderLayer`` -> ``slimformer.TransformerEncoderLayer``
  (``from_torch``), also inside ``torch.nn.TransformerEncoder``;
* every other ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` -> ``slimformer.LayerNorm``
  / ``slimformer.RMSNorm`` (``from_torch``, memory-efficient mode);
* ``torch.nn.MultiheadAttention`` -> ``slimformer.MultiheadAttention`` (``from_torch``);
* the modules of the model families in ``_FAMILIES``, one integration module each
  (``slimformer.integrations.hf``):

  - encoder layers of HuggingFace BERT-family models (transformers >= 5: BERT, RoBERTa,
    XLM-RoBERTa, CamemBERT, ELECTRA, ERNIE, Data2VecText, RoCBert, and so the
    sentence-transformers models built on them) -> ``Fused<Layer>``, a subclass of the
    layer's own class running attention, the two add + LayerNorms and the MLP on fused
    kernels; their embeddings' LayerNorm and dropout -> one fused norm kernel
    (``slimformer.integrations.hf.bert``); the same for DistilBERT's blocks and ALBERT's
    (shared) layers and their embeddings (``...hf.distilbert``, ``...hf.albert``), MPNet's and
    ModernBERT's (``...hf.mpnet``, ``...hf.modernbert``), and DeBERTa-v2/-v3's layers, their
    disentangled attention in one kernel (``...hf.deberta``);
  - HuggingFace BERT-family ``*ForMaskedLM`` models (BERT, ERNIE, RoBERTa, XLM-RoBERTa,
    CamemBERT, Data2VecText), ``BertForPreTraining``, ``DistilBertForMaskedLM`` and
    ``AlbertForMaskedLM`` change class in place to
    ``Fused<Model>``, whose training loss skips the vocabulary logits (``logits`` is None
    when that loss is fused; ``slimformer.integrations.hf.masked_lm``);
  - with ``unpad=True``, HuggingFace BERT-family base models (``BertModel``,
    ``RobertaModel`` ...) whose encoder layers are all fused change class in place to
    ``Unpadded<Model>``, which runs padded batches on their real tokens only
    (``slimformer.integrations.hf.unpad``);
  - HuggingFace RMSNorms whose forward is LlamaRMSNorm's, checked against its source
    (Llama, Mistral, Qwen2/3 and about 130 more families in transformers 5) ->
    ``Fused<Norm>``, which normalises in one kernel and then multiplies by the weight in
    the input's dtype, exactly as the original casts before it scales
    (``slimformer.integrations.hf.llama``).

Only those exact classes are swapped: a subclass may compute something else, so it is
left, and the summary says why. So is every other module whose class name says it is
an attention, an MLP or a norm (GPT-2's attention and MLP, Llama's, Gemma's
``(1 + weight)`` RMSNorm ...). ``patch`` returns the model; what it did is
``patch_summary(model)``, printable as plain text or a rich table. A new model family is
one integration module whose ``FAMILY`` (a ``slimformer.integrations.ModelFamily``) is
added to ``_FAMILIES``.

The attention implementation is the user's: ``patch`` never changes
``config._attn_implementation`` (transformers' default, "sdpa", or what was asked for,
reads back the same), and ``model.set_attn_implementation`` after the patch is honoured.
The fused layers run the fused kernel under "eager", "sdpa", "slimformer" and flash
attention alike, since the result is the same: they read the mask transformers builds
for the implementation as it is (eager's and sdpa's (batch, 1, seq, seq) masks, shared by
all layers, or a (batch, seq) padding mask). A call that asks for the attention weights
runs the original layer, so the implementation answers as it would unpatched: "eager"
returns the weights, "slimformer" forms them in PyTorch, "sdpa" returns none (and
transformers warns). Under ``torch.compile`` transformers builds the (batch, 1, seq,
seq) mask of "eager" and "sdpa" even without padding (4 MiB at batch 4, seq 512 in
fp32, kept for backward); ``model.set_attn_implementation("slimformer")`` (registered
when transformers is imported, see ``register_transformers_attention``) passes the
(batch, seq) padding mask instead.

Every class ``patch`` makes at run time (``Fused<Layer>``, ``Fused<Model>``,
``Unpadded<Model>``) has the original's ``forward`` signature, as ``inspect.signature``
reads it: transformers' Trainer keeps the dataset columns the model takes.

Patch before wrapping the model (DDP, FSDP, ``torch.compile``). Hooks registered on a
swapped module before the patch move to its replacement; hooks added afterwards are
dropped by ``unpatch``.
"""

import re
import warnings
from dataclasses import dataclass

from torch import nn

from slimformer.integrations.hf import albert, bert, deberta, distilbert, llama, modernbert, mpnet
from slimformer.integrations.hf.bert import FusedBertFamilyLayer
from slimformer.integrations.hf.classes import new_mixed
from slimformer.integrations.hf.llama import FusedLlamaStyleRMSNorm
from slimformer.layers.attention import MultiheadAttention
from slimformer.layers.memory_modes import MEMORY_MODES
from slimformer.layers.norm import LayerNorm, RMSNorm
from slimformer.layers.policies import check_policy
from slimformer.layers.sharing import (
    TorchLayerNorm,
    TorchMultiheadAttention,
    TorchRMSNorm,
    TorchTransformerEncoderLayer,
)
from slimformer.layers.transformer import TransformerEncoderLayer

# The two Fused* mixins live in slimformer.integrations.hf; re-exported here, their import
# path in earlier releases.
__all__ = [
    "FusedBertFamilyLayer",
    "FusedLlamaStyleRMSNorm",
    "ClassSwap",
    "Left",
    "PatchSummary",
    "Swap",
    "patch",
    "patch_summary",
    "unpatch",
]

# The model families patch recognises, asked in this order about every module that is no
# torch.nn swap: one integration module each.
# DeBERTa-v2 before BERT: its layer has BERT's submodule names, which BERT's family
# would leave as a look-alike.
_FAMILIES = (
    deberta.FAMILY,
    bert.FAMILY,
    distilbert.FAMILY,
    albert.FAMILY,
    mpnet.FAMILY,
    modernbert.FAMILY,
    llama.FAMILY,
)
_RECORD = "_slimformer_patch"
_MASKED_LM_CHANGE = "masked-LM loss fused with the decoder"
_UNPAD_CHANGE = "unpadded: packed real tokens, varlen attention"


def _rebuild_fused_layer(original_class: type, state: dict, mixin: type | None = None) -> nn.Module:
    # Pickles of patched models from before the integrations moved to slimformer.integrations.hf
    # name this function; new ones name slimformer.integrations.hf.classes.new_mixed.
    layer = new_mixed(mixin or FusedBertFamilyLayer, original_class)
    layer.__dict__.update(state)
    return layer


# Class names of the modules the summary accounts for when they are left.
_ROLES = {
    "attention": re.compile(r"Attention|Attn", re.I),
    "MLP": re.compile(r"MLP|FeedForward|FFN", re.I),
    "norm": re.compile(r"Norm"),
}


def _left_role_reason(module: nn.Module) -> str | None:
    """Why an attention / MLP / norm module that is no swap candidate is left, or None
    for modules of other roles."""
    name = type(module).__name__
    from_transformers = type(module).__module__.startswith("transformers.")
    if _ROLES["attention"].search(name):
        reason = (
            "attention of a model family slimformer does not fuse layer by layer (it fuses BERT-family, DistilBERT, "
            "ALBERT, MPNet, ModernBERT and DeBERTa-v2 encoder layers, torch.nn.TransformerEncoderLayer and "
            "torch.nn.MultiheadAttention)"
        )
        if from_transformers:
            reason += "; run it on slimformer's kernel with model.set_attn_implementation('slimformer')"
        return reason
    if _ROLES["MLP"].search(name):
        return (
            "no drop-in for this MLP (the fused MLP replaces the feed-forward of BERT-family, DistilBERT and ALBERT "
            "layers and torch.nn.TransformerEncoderLayer)"
        )
    # A norm without parameters of its own (sentence-transformers' Normalize: the L2
    # normalisation of embeddings) is no normalisation layer a kernel could replace.
    if _ROLES["norm"].search(name) and next(module.parameters(recurse=False), None) is not None:
        return (
            "not torch.nn.LayerNorm / RMSNorm nor an RMSNorm computing LlamaRMSNorm's forward, so its result may "
            "differ (e.g. Gemma's 1 + weight, T5's cast to the weight's dtype, batch or group statistics)"
        )
    return None


def _is_slimformer(module: nn.Module) -> bool:
    return type(module).__module__.startswith("slimformer.")


def _replacement(module: nn.Module) -> tuple[nn.Module | None, str | None]:
    """(the module to put in ``module``'s place, None) or (None, why it is left, or None
    when it is no candidate at all)."""
    kind = type(module)
    if kind is TorchTransformerEncoderLayer:
        try:
            return TransformerEncoderLayer.from_torch(module), None
        except ValueError as error:
            return None, str(error)
    if kind is TorchLayerNorm:
        return LayerNorm.from_torch(module), None
    if kind is TorchRMSNorm:
        return RMSNorm.from_torch(module), None
    if kind is TorchMultiheadAttention:
        return MultiheadAttention.from_torch(module), None
    for base in (TorchTransformerEncoderLayer, TorchLayerNorm, TorchRMSNorm, TorchMultiheadAttention):
        if isinstance(module, base):
            return None, f"subclass of torch.nn.{base.__name__} whose forward may differ"
    for family in _FAMILIES:
        answer = family.replace(module)
        if answer is not None:
            return answer
    return None, _left_role_reason(module)


def _child_swaps(module: nn.Module, name: str) -> tuple[list["Swap"], str | None]:
    """The swaps of ``module``'s children that a family fuses together while ``module``
    stays, or ([], why not), or ([], None) when no family fuses its children."""
    for family in _FAMILIES:
        answer = family.replace_children and family.replace_children(module)
        if answer is not None:
            children, problem = answer
            prefix = f"{name}." if name else ""
            swaps = [Swap(f"{prefix}{child}", module, getattr(module, child), new) for child, new in children.items()]
            return swaps, problem
    return [], None


@dataclass(frozen=True)
class Swap:
    """One module replaced: where it sits (``parent`` is None for the model itself) and
    both objects, which ``unpatch`` puts back."""

    name: str
    parent: nn.Module | None
    original: nn.Module
    replacement: nn.Module

    @property
    def attribute(self) -> str:
        return self.name.rpartition(".")[2]


@dataclass(frozen=True)
class ClassSwap:
    """One module whose class ``patch`` changed in place (a ``*ForMaskedLM`` model, or an
    unpadded base model), and its class before, which ``unpatch`` restores."""

    name: str
    module: nn.Module
    original_class: type
    change: str = _MASKED_LM_CHANGE


@dataclass(frozen=True)
class Left:
    """A candidate module that ``patch`` did not replace, and why."""

    name: str
    type_name: str
    reason: str


@dataclass(frozen=True)
class PatchSummary:
    """What ``patch`` did to one model. ``print`` gives plain text; rich's ``print``
    (or ``Console.print``) a table. Held by the patched model for ``unpatch``."""

    model_type: str
    swapped: tuple[Swap, ...]
    left: tuple[Left, ...]
    # the policy patch gave the swapped layers that take one (None: none given, or none takes one)
    recompute: str | None
    # nn.TransformerEncoders whose nested-tensor fast path patch turned off (their
    # layers are slimformer's now, which take padded tensors and a padding mask)
    nested_tensor_off: tuple[nn.Module, ...] = ()
    patched: bool = True
    class_swaps: tuple[ClassSwap, ...] = ()
    # the policy patch was given where no swapped module takes one (``recompute`` is then None)
    unused_recompute: str | None = None

    def title(self) -> str:
        call = f"slimformer.patch({self.model_type}, recompute={self.recompute!r})"
        if self.unused_recompute is not None:
            call = f"slimformer.patch({self.model_type}, recompute={self.unused_recompute!r} applies to nothing)"
        if not self.patched:
            call = f"{self.model_type}, not patched"
        return f"{call}: {len(self.swapped) + len(self.class_swaps)} swapped, {len(self.left)} left"

    def rows(self) -> list[tuple[str, str, str]]:
        """(module, original type, what it became or why it was left), one per module."""
        rows = [
            (
                swap.name or "(model)",
                swap.original_class.__name__,
                f"-> slimformer {type(swap.module).__name__} ({swap.change})",
            )
            for swap in self.class_swaps
        ]
        for swap in self.swapped:
            result = f"-> slimformer {type(swap.replacement).__name__}"
            policy = getattr(swap.replacement, "recompute", None)
            if policy is not None:
                result += f" (recompute={policy!r})"
            rows.append((swap.name or "(model)", type(swap.original).__name__, result))
        rows.extend((left.name or "(model)", left.type_name, f"left: {left.reason}") for left in self.left)
        return rows

    def __str__(self) -> str:
        rows = [("module", "type", "result"), *self.rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(2)]
        lines = [f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}" for row in rows]
        return "\n".join([self.title(), *lines])

    def __rich__(self):
        from rich.table import Table
        from rich.text import Text

        table = Table(title=self.title())
        for column in ("module", "type", "result"):
            table.add_column(column)
        for row in self.rows():
            table.add_row(*(Text(cell) for cell in row))
        return table


def _plan(model: nn.Module) -> tuple[list[Swap], list[Left]]:
    """Swaps and leftovers, walking the module tree; a swapped module is not entered.

    Inside a module that is left, only norms are listed again (they may still be
    swapped); its attention and MLP are covered by its own reason."""
    swaps, left, replacements = [], [], {}

    def visit(module: nn.Module, name: str, parent: nn.Module | None, inside_left: bool) -> None:
        if _is_slimformer(module):
            return
        if id(module) not in replacements:  # a module registered twice gets one replacement
            replacements[id(module)] = _replacement(module)
            reason = replacements[id(module)][1]
            if reason is not None and (not inside_left or _ROLES["norm"].search(type(module).__name__)):
                left.append(Left(name, type(module).__name__, reason))
        replacement, reason = replacements[id(module)]
        if replacement is not None:
            swaps.append(Swap(name, parent, module, replacement))
            return
        fused_children, problem = _child_swaps(module, name)
        swaps.extend(fused_children)
        if problem is not None:
            left.append(Left(name, type(module).__name__, problem))
        done = {swap.attribute for swap in fused_children}
        for child_name, child in module.named_children():
            if child_name not in done:
                visit(child, f"{name}.{child_name}" if name else child_name, module, inside_left or reason is not None)

    visit(model, "", None, False)
    return swaps, left


def _plan_class_swaps(
    root: nn.Module, question: str, change: str | None
) -> tuple[list[tuple[ClassSwap, type]], list[Left]]:
    """The modules in ``root`` whose class a family changes in place (``question``: "fuse_loss",
    "unpad" or "change_class", see ``ModelFamily``), each with its new class, and those it
    cannot change; ``change`` None: the family's ``class_change`` says what changes."""
    swaps, left = [], []
    for name, module in root.named_modules():
        if _is_slimformer(module):
            continue
        for family in _FAMILIES:
            answer = getattr(family, question) and getattr(family, question)(module)
            if answer is None:
                continue
            new_class, problem = answer
            if problem is None:
                swaps.append((ClassSwap(name, module, type(module), change or family.class_change), new_class))
            else:
                left.append(Left(name, type(module).__name__, problem))
            break
    return swaps, left


def patch(model: nn.Module, recompute: str | None = None, unpad: bool = False) -> nn.Module:
    """Swap slimformer's fused layers into ``model`` in place (see the module docstring).

    Args:
        model: any ``nn.Module``; patch it before wrapping it in DDP, FSDP or
            ``torch.compile``.
        recompute: policy for the swapped layers that take one ("none", "qkv", "mlp",
            "qkv+mlp", "full"); None leaves them at "none". ``slimformer.recompute``
            changes it later. A policy that no swapped module takes (a GPT-2, whose
            norms only are swapped) warns with a ``UserWarning``, and the summary says
            it applies to nothing.
        unpad: also unpad BERT-family base models (``slimformer.integrations.hf.unpad``): with a padded
            ``attention_mask``, every layer runs on the real tokens only, and padded
            positions of ``last_hidden_state`` are zeros. Off by default.

    Returns:
        ``model`` (or its replacement, when ``model`` is itself a swappable layer), with
        ``patch_summary`` of it telling what was swapped and what was left and why. A
        model that is already patched, or has nothing to patch, is returned unchanged
        with a ``UserWarning`` saying so.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``unpad`` is not a bool.
        ValueError: ``recompute`` is not a policy.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(unpad, bool):
        raise TypeError(f"unpad must be a bool, got {type(unpad).__name__} {unpad!r}")
    if recompute is not None:
        check_policy(recompute)
    patched = [name or "the model itself" for name, module in model.named_modules() if _RECORD in module.__dict__]
    if patched:
        warnings.warn(
            f"slimformer.patch: {type(model).__name__} is already patched ({', '.join(patched)}); nothing changed. "
            "Call slimformer.unpatch first to patch it again.",
            stacklevel=2,
        )
        return model
    model_type = type(model).__name__
    swaps, left = _plan(model)
    loss_swaps, heads_left = _plan_class_swaps(model, "fuse_loss", _MASKED_LM_CHANGE)
    left += heads_left
    class_swaps = [class_swap for class_swap, _ in loss_swaps]
    if not swaps and not class_swaps:
        reasons = "".join(f"\n  {item.name or '(model)'} ({item.type_name}): {item.reason}" for item in left)
        warnings.warn(
            f"slimformer.patch: nothing to patch in {type(model).__name__}; nothing changed.{reasons}", stacklevel=2
        )
        return model
    for swap in swaps:
        if recompute is not None and hasattr(swap.replacement, "recompute"):
            swap.replacement.recompute = recompute
        if swap.parent is not None:
            setattr(swap.parent, swap.attribute, swap.replacement)
    for class_swap, new_class in loss_swaps:
        class_swap.module.__class__ = new_class
    root = swaps[0].replacement if swaps and swaps[0].parent is None else model
    changed, changes_left = _plan_class_swaps(root, "change_class", None)
    for class_swap, new_class in changed:
        class_swap.module.__class__ = new_class
        class_swaps.append(class_swap)
    left += changes_left
    nested_off = tuple(
        encoder
        for encoder in root.modules()
        if isinstance(encoder, nn.TransformerEncoder)
        and getattr(encoder, "use_nested_tensor", False)
        and any(isinstance(layer, TransformerEncoderLayer) for layer in encoder.layers)
    )
    for encoder in nested_off:
        encoder.use_nested_tensor = False
    if unpad:
        unpad_swaps, unpad_left = _plan_class_swaps(root, "unpad", _UNPAD_CHANGE)
        if not unpad_swaps:
            why = "; ".join(f"{item.name or item.type_name}: {item.reason}" for item in unpad_left)
            warnings.warn(
                f"slimformer.patch: unpad=True but nothing is unpadded in {type(model).__name__} "
                f"({why or 'no base model of a family slimformer unpads, with its encoder layers all fused'})",
                stacklevel=2,
            )
        for class_swap, new_class in unpad_swaps:
            class_swap.module.__class__ = new_class
            class_swaps.append(class_swap)
        left += unpad_left
    unused = None
    if recompute is not None and not any(hasattr(swap.replacement, "recompute") for swap in swaps):
        unused, recompute = recompute, None
        warnings.warn(
            f"slimformer.patch: recompute={unused!r} applies to nothing in {model_type}: none of the modules "
            "it swapped takes a recompute policy (fused BERT-family encoder layers and "
            "torch.nn.TransformerEncoderLayer do)",
            stacklevel=2,
        )
    summary = PatchSummary(
        model_type,
        tuple(swaps),
        tuple(left),
        recompute,
        nested_off,
        class_swaps=tuple(class_swaps),
        unused_recompute=unused,
    )
    setattr(root, _RECORD, summary)
    # Decide the norms' memory modes now (one host sync): a model compiled before its first
    # eager step would otherwise trace the safe mode, keeping each norm's input too.
    MEMORY_MODES.refresh()
    return root


def patch_summary(model: nn.Module) -> PatchSummary:
    """What ``patch`` did to ``model``: every module swapped, and every candidate,
    attention, MLP and norm module left with the reason. Never raises for a module.

    For a model that is not patched (``patch`` was not called, or found nothing to
    swap) the summary has no swaps, and lists what ``patch`` would swap as left with
    the reason "not patched"; its ``patched`` is False.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    summary = getattr(model, _RECORD, None)
    if summary is not None:
        return summary
    swaps, left = _plan(model)
    loss_swaps, heads_left = _plan_class_swaps(model, "fuse_loss", _MASKED_LM_CHANGE)
    would_swap = tuple(
        Left(swap.name, swap.original_class.__name__, "not patched (slimformer.patch would fuse its masked-LM loss)")
        for swap, _ in loss_swaps
    ) + tuple(
        Left(
            swap.name,
            type(swap.original).__name__,
            f"not patched (slimformer.patch would swap it for slimformer {type(swap.replacement).__name__})",
        )
        for swap in swaps
    )
    return PatchSummary(type(model).__name__, (), (*would_swap, *left, *heads_left), None, patched=False)


def _recorded_summary(model: nn.Module) -> PatchSummary:
    summary = getattr(model, _RECORD, None)
    if summary is None:
        raise ValueError(
            f"{type(model).__name__} is not patched: slimformer.patch returned it unchanged or was not called"
        )
    return summary


def unpatch(model: nn.Module) -> nn.Module:
    """Put back the exact module objects ``patch`` replaced; returns the original model.

    The originals take the train/eval mode of their replacements. Raises ValueError if
    ``model`` is not patched, or if a swapped module is no longer where ``patch`` put it
    (then nothing is changed).
    """
    summary = _recorded_summary(model)
    for swap in summary.swapped:
        if swap.parent is not None and swap.parent._modules.get(swap.attribute) is not swap.replacement:
            raise ValueError(f"{swap.name or 'the model'} was replaced after patching; not restoring any module")
    for swap in reversed(summary.swapped):
        swap.original.train(swap.replacement.training)
        if swap.parent is not None:
            setattr(swap.parent, swap.attribute, swap.original)
    for encoder in summary.nested_tensor_off:
        encoder.use_nested_tensor = True
    for class_swap in summary.class_swaps:
        class_swap.module.__class__ = class_swap.original_class
    delattr(model, _RECORD)
    swapped_self = summary.swapped and summary.swapped[0].parent is None
    return summary.swapped[0].original if swapped_self else model
