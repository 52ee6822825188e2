"""Model-level FP16/INT8 conversion, SmoothQuant calibration, save/load and fidelity.

``quantize(model, mode)`` swaps every ``nn.Linear`` for a ``Linear8bit`` (modes "int8",
"int8-weight-only") or ``Linear16bit`` ("fp16", "bf16") in place and puts the model in
eval mode (``model.eval()``: the quantized layers are for inference, and a model left in
training mode would keep its dropout on). Embeddings,
LayerNorm and softmax are not Linears and stay as they are; the classifier and LM
heads stay float by default (``DEFAULT_SKIP``). Every replacement is built before
the first one is swapped in, so an error leaves the model untouched. In a
``slimformer.patch``-ed model, the Linears of fused BERT-family layers and unpadded base
models are converted (those modules call them as modules); a Linear whose float weight
another fused module reads (a patched ``*ForMaskedLM`` head, a slimformer
``TransformerEncoderLayer``) is refused.

SmoothQuant (mode "int8", ``calibration=`` batches): activation outliers concentrate in
a few input channels, which per-token scales cannot isolate. With a_j = max|x_j| over
the calibration tokens and w_j = max_n |W[n, j]|, each channel is divided by
s_j = a_j^α / w_j^(1-α) and the weight column multiplied by it, which flattens the
activation at the cost of the weight (α = ``smooth_alpha``, default 0.5). The division
is fused into the per-token quantization kernel (``Linear8bit.smooth`` = 1 / s).

``save_quantized`` / ``load_quantized`` write and read ``model.safetensors`` (the plain
state_dict, less the empty ``smooth`` of unsmoothed "int8" layers) plus
``slimformer_quantization.json`` (the mode of each converted module). A transformers
``PreTrainedModel`` that ``quantize`` or ``load_quantized`` converts also gets
transformers' record of it (``slimformer.integrations.hf.quantizer``), so that
``model.save_pretrained(dir)`` writes the same state_dict with the modes in
``config.json``'s ``quantization_config`` and ``from_pretrained(dir)`` reloads it;
``load_quantized`` reads such a directory too. There the int8 weights are flattened to
(out_features · in_features,) (``checkpoint_format`` 2): transformers without slimformer,
which skips a quant_method it does not know, then refuses them as mismatched shapes
instead of loading int8 values into float Linears.
``fidelity_report`` measures each quantized layer's SQNR on the float model's own
inputs to that layer, and the agreement of the two models' outputs.
"""

import json
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_model
from torch import nn
from tqdm.auto import tqdm

from slimformer.kernels import int8_cpu
from slimformer.layers.linear import FLOAT16_MODES, INT8_MODES, Linear8bit, Linear16bit

MODES = (*INT8_MODES, *FLOAT16_MODES)
# Dotted name parts of the heads that stay float unless ``skip`` says otherwise (HF
# BERT: classifier, cls (the MLM head), qa_outputs; decoders: lm_head, score). BERT's
# pooler is quantized, as torch's quantize_dynamic quantizes it.
DEFAULT_SKIP = ("classifier", "cls", "qa_outputs", "lm_head", "score")
DEFAULT_SMOOTH_ALPHA = 0.5
CONFIG_FILE = "slimformer_quantization.json"
WEIGHTS_FILE = "model.safetensors"
# save_pretrained's file, and the quant_method under which transformers knows slimformer.
TRANSFORMERS_CONFIG_FILE = "config.json"
TRANSFORMERS_QUANT_METHOD = "slimformer"
# quantization_config's "checkpoint_format": 1, int8 weights saved (out, in), as before it
# existed (a record without one); 2, flattened to (out * in,), a shape no float nn.Linear takes.
TRANSFORMERS_CHECKPOINT_FORMATS = (1, 2)
TRANSFORMERS_CHECKPOINT_FORMAT = 2
_CONFIG_FORMAT = 1
# SmoothQuant factors are kept within this range of 1 so no channel is scaled to nothing.
_MAX_SMOOTH_RATIO = 1e4

SkipRule = Sequence[str] | Callable[[str, nn.Module], bool]


def _is_skipped(name: str, module: nn.Module, skip: SkipRule) -> bool:
    if callable(skip):
        return bool(skip(name, module))
    parts = name.split(".")
    return any(name == s or name.startswith(s + ".") or s in parts for s in skip)


def _check_module(name: str, value) -> None:
    if not isinstance(value, nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(value).__name__}")


def _check_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _directory(value) -> Path:
    if not isinstance(value, (str, Path)):
        raise TypeError(f"directory must be a str or pathlib.Path, got {type(value).__name__}")
    return Path(value)


def _check_skip(skip) -> None:
    if callable(skip):
        return
    if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
        raise TypeError(f"skip must be a sequence of module names or a callable (name, module) -> bool, got {skip!r}")


def _run(model: nn.Module, batch):
    """Call ``model`` on one batch: a mapping is keyword arguments, a tuple/list positional ones."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


class _EvalMode:
    """Put a model in eval mode for a with-block, then restore every module's flag."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self):
        self.flags = {module: module.training for module in self.model.modules()}
        self.model.eval()

    def __exit__(self, *exc):
        for module, training in self.flags.items():
            module.training = training


def _linear_aliases(model: nn.Module) -> dict[str, list[str]]:
    """{first name: every name} of each nn.Linear; a Linear registered under several names
    (shared between blocks, say) is one entry, so it is converted once and stays shared."""
    names_by_module: dict[nn.Module, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if type(module) is nn.Linear:
            names_by_module.setdefault(module, []).append(name)
    return {names[0]: names for names in names_by_module.values()}


def linears_to_convert(model: nn.Module, skip: SkipRule) -> tuple[dict[str, nn.Linear], dict[str, list[str]]]:
    """({first name: Linear} to convert, {first name: every name}); raises ValueError for a
    shared Linear that ``skip`` skips under some of its names only."""
    fused = {
        name: module
        for name, module in model.named_modules()
        if type(module).__module__.startswith("slimformer.") and not isinstance(module, (Linear8bit, Linear16bit))
    }
    linears, aliases = {}, {}
    for first, names in _linear_aliases(model).items():
        module = model.get_submodule(first)
        skipped = [_is_skipped(name, module, skip) for name in names]
        if any(skipped) and not all(skipped):
            raise ValueError(f"the Linear shared as {names} is skipped under some of its names only: skip all or none")
        if skipped[0]:
            continue
        # the innermost fused module (a patched *ForMaskedLM model holds fused layers); those
        # that call their Linears as modules (patched BERT layers, unpadded models) take ours
        owner = max((name for name in fused if first.startswith(f"{name}.") or not name), key=len, default=None)
        if owner is not None and not getattr(fused[owner], "accepts_quantized_linears", False):
            raise ValueError(
                f"{first!r} is inside the slimformer {type(fused[owner]).__name__} {owner!r}, whose fused kernels "
                "read its float weight: quantize the unpatched model (slimformer.unpatch), or skip it"
            )
        linears[first], aliases[first] = module, names
    return linears, aliases


def calibrate_activations(model: nn.Module, linears: Mapping[str, nn.Linear], calibration: Iterable) -> dict:
    """Per-input-channel max |x| seen by each of ``linears`` over the calibration batches.

    Runs ``model`` in eval mode without grad on each batch (a progress bar counts them).
    Returns {name: (in_features,) fp32 tensor}. Raises ValueError if calibration yields
    no batch, or a Linear saw no input; TypeError if model is not an nn.Module.
    """
    _check_module("model", model)
    maxima: dict[str, torch.Tensor] = {}

    def recorder(name):
        def hook(module, args):
            x = args[0].detach()
            batch_max = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
            maxima[name] = batch_max if name not in maxima else torch.maximum(maxima[name], batch_max)

        return hook

    handles = [linear.register_forward_pre_hook(recorder(name)) for name, linear in linears.items()]
    batches = 0
    try:
        with torch.no_grad(), _EvalMode(model):
            for batch in tqdm(calibration, desc="SmoothQuant calibration", unit="batch"):
                _run(model, batch)
                batches += 1
    finally:
        for handle in handles:
            handle.remove()
    if batches == 0:
        raise ValueError("calibration yielded no batch: pass an iterable of model inputs")
    unseen = sorted(set(linears) - set(maxima))
    if unseen:
        raise ValueError(f"calibration never reached these Linears: {unseen[:5]}{' ...' if len(unseen) > 5 else ''}")
    return maxima


def smoothing_factors(activation_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's input multipliers 1 / s, s_j = a_j^α / w_j^(1-α), for one Linear.

    activation_max: (K,) max |x_j|; weight: (N, K). Channels that were always zero, or
    whose weight column is zero, keep multiplier 1. Returns (K,) fp32. Raises TypeError
    if either is not a tensor.
    """
    _check_tensor("activation_max", activation_max)
    _check_tensor("weight", weight)
    a = activation_max.float()
    w = weight.detach().abs().amax(dim=0).float().to(a.device)
    usable = (a > 0) & (w > 0)
    s = torch.where(usable, a.clamp_min(1e-30).pow(alpha) / w.clamp_min(1e-30).pow(1 - alpha), 1.0)
    return (1.0 / s).clamp(1 / _MAX_SMOOTH_RATIO, _MAX_SMOOTH_RATIO)


def _convert(name: str, linear: nn.Linear, mode: str, smooth: torch.Tensor | None) -> nn.Module:
    try:
        if mode in FLOAT16_MODES:
            return Linear16bit.from_float(linear, FLOAT16_MODES[mode])
        return Linear8bit.from_float(linear, mode, smooth=smooth)
    except ValueError as err:
        raise ValueError(f"cannot quantize {name!r}: {err}") from err


def swap_modules(model: nn.Module, replacements: Mapping[str, nn.Module]) -> None:
    """Put each of ``replacements`` ({dotted name: module}) in ``model`` under its name."""
    for name, module in replacements.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module)


def quantize(
    model: nn.Module,
    mode: str,
    *,
    skip: SkipRule = DEFAULT_SKIP,
    calibration: Iterable | None = None,
    smooth_alpha: float | None = None,
) -> nn.Module:
    """Replace ``model``'s nn.Linear modules by quantized inference layers, in place.

    mode: "int8" (W8A8, dynamic per-token activation scales; on a CPU without VNNI or AMX
        it is slower than fp32 and warns once), "int8-weight-only" (W8A16; on a CPU with
        VNNI or AMX the activation is rounded per token to 16-bit fixed point, elsewhere the
        fp32 GEMM multiplies it, ``Linear8bit``),
        "fp16" or "bf16" (16-bit weights, fp32 accumulation).
    skip: Linears to leave float: names (a Linear is skipped if its name equals one,
        starts with one plus ".", or has one as a dotted part) or a callable
        (name, module) -> bool. Default: the classifier/LM heads (``DEFAULT_SKIP``).
    calibration: mode "int8" only: an iterable of model inputs (a dict: keyword
        arguments; a tuple/list: positional ones; else the single argument) for SmoothQuant.
    smooth_alpha: SmoothQuant's migration strength in [0, 1] (default 0.5 with
        calibration); needs calibration.
    Returns ``model``, in eval mode (every module's ``training`` False: quantized layers are
    for inference, and dropout left on would take the outputs far from the float model's).
    Raises ValueError on an unknown mode, no Linear left to convert,
    a calibration that yields nothing, a bad smooth_alpha, a non-finite weight, or a
    transformers model quantized by another method (the model is then unchanged);
    TypeError on a bad model or skip.
    """
    _check_module("model", model)
    _check_not_quantized_by_transformers(model)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _check_skip(skip)
    if (calibration is not None or smooth_alpha is not None) and mode != "int8":
        raise ValueError(f"calibration and smooth_alpha apply to mode 'int8' only, got mode {mode!r}")
    if smooth_alpha is not None:
        if calibration is None:
            raise ValueError("smooth_alpha needs calibration batches (calibration=...)")
        if not 0.0 <= smooth_alpha <= 1.0:
            raise ValueError(f"smooth_alpha must be in [0, 1], got {smooth_alpha}")
    linears, aliases = linears_to_convert(model, skip)
    if not linears:
        raise ValueError(f"model has no torch.nn.Linear left to quantize (skip={skip!r})")

    smooth = {}
    if calibration is not None:
        alpha = DEFAULT_SMOOTH_ALPHA if smooth_alpha is None else smooth_alpha
        maxima = calibrate_activations(model, linears, calibration)
        smooth = {name: smoothing_factors(maxima[name], linear.weight, alpha) for name, linear in linears.items()}
    replacements = {name: _convert(name, linear, mode, smooth.get(name)) for name, linear in linears.items()}
    swap_modules(model, {alias: replacements[name] for name in replacements for alias in aliases[name]})
    _record_in_transformers(model)
    model.eval()
    if mode == "int8" and any(layer.weight.is_cpu for layer in replacements.values()):
        _warn_once_if_int8_is_slow_here()
    return model


_warned_int8_is_slow = False


def _warn_once_if_int8_is_slow_here() -> None:
    """Once per process: W8A8 where no exact int8 GEMM measured fast here (``int8_cpu.int8_gemm_is_fast``)
    is no faster than fp32."""
    global _warned_int8_is_slow
    if _warned_int8_is_slow or int8_cpu.int8_gemm_is_fast():
        return
    _warned_int8_is_slow = True
    warnings.warn(
        f"slimformer 'int8' on this CPU ({int8_cpu.cpu_isa()}) is slower than fp32: no int8 GEMM that sums exactly "
        "measured under half an fp32 GEMM's time here (without VNNI or AMX none does), and W8A8 adds the per-token "
        "quantization (1.1-1.2x fp32's latency on an AMD EPYC with AVX2). Faster here: the fp32 model, "
        "or 'int8-weight-only' (int8 weights, the fp32 GEMM on such CPUs); docs/quantization.md",
        UserWarning,
        stacklevel=3,
    )


def _check_not_quantized_by_transformers(model: nn.Module) -> None:
    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if quantizer is not None and method != TRANSFORMERS_QUANT_METHOD:
        raise ValueError(
            f"model was quantized by transformers with {getattr(method, 'value', method)!r}: "
            "load its float checkpoint to quantize it with slimformer"
        )


def _record_in_transformers(model: nn.Module) -> None:
    """Give a transformers model the record ``save_pretrained`` writes and ``from_pretrained``
    reads; transformers is not imported for it (a model of its can only exist once it is)."""
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        from slimformer.integrations.hf.quantizer import record_quantization

        record_quantization(model)


def quantized_modules(model: nn.Module) -> dict[str, str]:
    """{module name: mode} of every slimformer quantized layer in ``model`` (a shared layer under each name).

    Raises TypeError if model is not an nn.Module.
    """
    _check_module("model", model)
    return {
        name: m.mode
        for name, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, (Linear8bit, Linear16bit))
    }


def save_quantized(model: nn.Module, directory: str | Path) -> Path:
    """Write ``model``'s state_dict to ``directory/model.safetensors`` and the mode of each
    quantized module to ``directory/slimformer_quantization.json``. Returns the directory.

    Raises ValueError if ``model`` has no quantized module; TypeError if model is not an
    nn.Module or directory not a str or Path.
    """
    modules = quantized_modules(model)
    directory = _directory(directory)
    if not modules:
        raise ValueError("model has no slimformer quantized layer: call slimformer.quantize(model, mode) first")
    directory.mkdir(parents=True, exist_ok=True)
    # An empty smooth only marks an "int8" state_dict, which the config does in the file.
    handles = [
        m.register_state_dict_post_hook(_drop_empty_smooth) for m in model.modules() if isinstance(m, Linear8bit)
    ]
    try:
        save_model(model, str(directory / WEIGHTS_FILE))
    finally:
        for handle in handles:
            handle.remove()
    config = {"format": _CONFIG_FORMAT, "modules": modules}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return directory


def _drop_empty_smooth(module, state_dict, prefix, local_metadata) -> None:
    if prefix + "smooth" in state_dict and state_dict[prefix + "smooth"].numel() == 0:
        del state_dict[prefix + "smooth"]


def load_quantized(model: nn.Module, directory: str | Path) -> nn.Module:
    """Quantize a freshly built float ``model`` as recorded in ``directory`` and load its weights.

    directory: what ``save_quantized`` wrote, or what a transformers model's
    ``save_pretrained`` wrote after slimformer quantized it (its ``config.json`` holds the
    record; ``from_pretrained`` loads it too, without a float model; its int8 weights, flat
    there since ``checkpoint_format`` 2, get their (out, in) shape back). ``model`` must have
    the architecture that was saved (its float weights are replaced, in place, on the
    device they are on). Everything is checked before the first module is swapped, so an
    error leaves ``model`` untouched. Returns ``model``, in eval mode (as ``quantize``
    leaves it). Every error names the file (and
    the module, where one is at fault): FileNotFoundError without the record or the
    weights; ValueError for a file that cannot be read (not a directory, truncated or
    corrupt safetensors, a config that is not JSON or not a slimformer config, a
    config.json without slimformer's quantization_config, an unknown mode) or a module
    of the config that is missing or not an nn.Linear; RuntimeError if the weights do
    not fit (missing, unexpected or mis-shaped keys, a tensor of another dtype than the
    layer's, or another quantization mode); and TypeError if model is not an nn.Module
    or directory not a str or Path.
    """
    _check_module("model", model)
    _check_not_quantized_by_transformers(model)
    directory = _directory(directory)
    if not directory.is_dir():
        kind = "a file" if directory.exists() else "missing"
        error = ValueError if directory.exists() else FileNotFoundError
        raise error(f"load_quantized needs the directory save_quantized wrote, got {str(directory)!r} ({kind})")
    modules, config_path, checkpoint_format = _read_config(directory)
    modes, aliases = recorded_conversions(model, modules, config_path)
    weights_path = directory / WEIGHTS_FILE
    state = _read_weights(weights_path)
    if checkpoint_format >= 2:
        _unflatten_int8_weights(model, modes, aliases, state)
    replacements = {}
    for first, mode in modes.items():
        if mode == "int8":
            state.setdefault(f"{first}.smooth", torch.ones(0))  # dropped by save_quantized
        replacements[first] = _convert(first, model.get_submodule(first), mode, None)
        _load_module_state(replacements[first], first, state, weights_path)
    swaps = {alias: replacements[first] for first in replacements for alias in aliases[first]}
    try:
        _check_remaining_state(model, set(swaps), state)
    except RuntimeError as error:
        raise RuntimeError(f"{weights_path}: {error}") from None
    swap_modules(model, swaps)
    # Every key was checked above (tensors tied together, of which save_model kept one
    # name, load through that name).
    model.load_state_dict(state, strict=False)
    _record_in_transformers(model)
    return model.eval()


def recorded_conversions(
    model: nn.Module, modules: Mapping[str, str], source
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """({first name: mode}, {first name: every name}) of the nn.Linears of ``model`` that
    ``modules`` (a record: {name: mode}, as ``quantized_modules`` gives it) converts.

    Raises ValueError, naming ``source``, for a recorded name that is no nn.Linear of
    ``model``, or a shared Linear whose names the record gives several modes.
    """
    aliases = _linear_aliases(model)
    present = {alias for names in aliases.values() for alias in names}
    missing = sorted(set(modules) - present)
    if missing:
        raise ValueError(
            f"{source}: model has no nn.Linear named {missing[:5]}: it is not the architecture that was saved"
        )
    modes = {}
    for first, names in aliases.items():
        found = {modules.get(name) for name in names}
        if len(found) > 1:
            raise ValueError(f"{source} gives the Linear shared as {names} several modes: {sorted(map(str, found))}")
        mode = found.pop()
        if mode is not None:
            modes[first] = mode
    return modes, {first: aliases[first] for first in modes}


def _read_config(directory: Path) -> tuple[dict[str, str], Path, int]:
    """{module name: mode}, the file it came from and the layout of the int8 weights
    (``TRANSFORMERS_CHECKPOINT_FORMATS``): ``save_quantized``'s config (format 1), else the
    slimformer quantization_config of ``save_pretrained``'s config.json; errors name the file."""
    path = directory / CONFIG_FILE
    if path.exists():
        config = _read_json(path)
        if not isinstance(config, dict) or config.get("format") != _CONFIG_FORMAT:
            raise ValueError(f"{path} is not a slimformer quantization config (format {_CONFIG_FORMAT})")
        return checked_modes(config.get("modules"), path), path, 1
    path = directory / TRANSFORMERS_CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{directory} has neither {CONFIG_FILE} (save_quantized writes it) nor {TRANSFORMERS_CONFIG_FILE} "
            "(a transformers model's save_pretrained writes it)"
        )
    config = _read_json(path)
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method != TRANSFORMERS_QUANT_METHOD:
        raise ValueError(
            f"{path} has no slimformer quantization_config (quant_method {method!r}): a float or otherwise "
            "quantized checkpoint, which transformers' from_pretrained loads"
        )
    checkpoint_format = checked_checkpoint_format(quantization.get("checkpoint_format", 1), path)
    return checked_modes(quantization.get("modules"), path), path, checkpoint_format


def checked_checkpoint_format(value, source) -> int:
    """``value`` if it is one of ``TRANSFORMERS_CHECKPOINT_FORMATS``; else ValueError naming ``source``."""
    if isinstance(value, bool) or value not in TRANSFORMERS_CHECKPOINT_FORMATS:
        raise ValueError(
            f"{source}: checkpoint_format must be one of {TRANSFORMERS_CHECKPOINT_FORMATS}, got {value!r} "
            "(written by a newer slimformer?)"
        )
    return value


def _unflatten_int8_weights(model: nn.Module, modes, aliases, state: dict[str, torch.Tensor]) -> None:
    """Give the flat int8 weights of ``state`` (checkpoint_format 2) their Linears' (out, in)
    shape; a weight of another size is left for the strict load to report."""
    for first, mode in modes.items():
        if mode not in INT8_MODES:
            continue
        linear = model.get_submodule(first)
        shape = (linear.out_features, linear.in_features)
        for key in (f"{alias}.weight" for alias in aliases[first]):
            weight = state.get(key)
            if weight is not None and weight.dim() == 1 and weight.numel() == math.prod(shape):
                state[key] = weight.view(shape)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read the slimformer quantization config: {error}") from error


def checked_modes(modules, source) -> dict[str, str]:
    """``modules`` if it maps module names to modes; else ValueError naming ``source``."""
    if not isinstance(modules, dict) or not all(isinstance(name, str) for name in modules):
        raise ValueError(f"{source}: 'modules' must map module names to modes, got {modules!r:.80}")
    for name, mode in modules.items():
        if mode not in MODES:
            raise ValueError(f"{source}: module {name!r} has mode {mode!r}, not one of {MODES}")
    return modules


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no quantized weights (save_quantized writes them)")
    try:
        return load_file(path)
    except (OSError, SafetensorError) as error:
        raise ValueError(
            f"{path}: cannot read the quantized weights (truncated or not safetensors?): {error}"
        ) from error


def _load_module_state(module: nn.Module, name: str, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Load the entries of ``state`` under ``name.`` into ``module`` (strict), or raise
    RuntimeError naming ``path`` and the module; a tensor of another dtype than the
    layer's (which load_state_dict would convert) is refused."""
    prefix = f"{name}."
    own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    expected = {key: (tensor.dtype,) for key, tensor in module.state_dict().items()}
    expected.update(getattr(module, "loadable_dtypes", {}))
    wrong = [
        f"{key} is {tensor.dtype}, the layer's is {' or '.join(map(str, expected[key]))}"
        for key, tensor in own.items()
        if key in expected and tensor.dtype not in expected[key]
    ]
    if wrong:
        raise RuntimeError(f"{path}: module {name!r}: {'; '.join(wrong)}")
    try:
        module.load_state_dict(own, strict=True)
    except RuntimeError as error:
        raise RuntimeError(f"{path}: module {name!r}: {error}") from None


def _check_remaining_state(model: nn.Module, swapped: set[str], state: Mapping[str, torch.Tensor]) -> None:
    """Raise RuntimeError unless ``state`` has, outside the modules to swap, the model's keys
    and shapes (of tensors tied together, ``save_model`` keeps one name: one is enough)."""

    def outside(key: str) -> bool:
        return not any(key.startswith(f"{name}.") for name in swapped)

    model_state = {k: v for k, v in model.state_dict(keep_vars=True).items() if outside(k)}
    expected = {k: v.shape for k, v in model_state.items()}
    given = {k: v.shape for k, v in state.items() if outside(k)}
    tied: dict[tuple, set[str]] = {}
    for key, tensor in model_state.items():
        tied.setdefault((tensor.data_ptr(), tensor.shape), set()).add(key)
    problems = [
        f"missing {k}"
        for k in sorted(expected.keys() - given.keys())
        if not any(key in given for key in tied[(model_state[k].data_ptr(), model_state[k].shape)])
    ]
    problems += [f"unexpected {k}" for k in sorted(given.keys() - expected.keys())]
    problems += [
        f"{k}: saved {tuple(given[k])}, model {tuple(expected[k])}"
        for k in sorted(expected.keys() & given.keys())
        if given[k] != expected[k]
    ]
    if problems:
        raise RuntimeError(f"the saved weights do not fit this model: {'; '.join(problems[:5])}")


def _decibels(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def sqnr_db(actual: torch.Tensor, exact: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10 log10(Σ exact² / Σ (actual - exact)²), in dB.

    Raises TypeError if either is not a tensor.
    """
    _check_tensor("actual", actual)
    _check_tensor("exact", exact)
    exact = exact.double()
    return _decibels(exact.square().sum().item(), (actual.double() - exact).square().sum().item())


def _first_tensor(output) -> torch.Tensor:
    """The main tensor of a model's output: itself, ``last_hidden_state``/``logits``, or the first element."""
    if isinstance(output, torch.Tensor):
        return output
    for key in ("last_hidden_state", "logits"):
        if getattr(output, key, None) is not None:
            return getattr(output, key)
    if isinstance(output, Mapping):
        return _first_tensor(next(iter(output.values())))
    if isinstance(output, (tuple, list)) and output:
        return _first_tensor(output[0])
    raise TypeError(f"cannot find a tensor in the model output of type {type(output).__name__}")


@dataclass
class FidelityReport:
    """How closely a quantized model follows its float original on the same inputs.

    layer_sqnr_db: {name: SQNR in dB} of each quantized layer fed the float model's
    input to that layer. The output metrics compare the two models' main outputs
    (``output_fn``): SQNR, per-row cosine similarity over the last dimension (mean and
    minimum) and the largest absolute difference.
    """

    layer_sqnr_db: dict[str, float] = field(default_factory=dict)
    output_sqnr_db: float = math.nan
    mean_cosine: float = math.nan
    min_cosine: float = math.nan
    max_abs_error: float = math.nan

    @property
    def min_layer_sqnr_db(self) -> float:
        return min(self.layer_sqnr_db.values(), default=math.nan)

    def __str__(self) -> str:
        worst = min(self.layer_sqnr_db, key=self.layer_sqnr_db.get, default=None)
        lines = [
            f"layers: {len(self.layer_sqnr_db)}, min SQNR {self.min_layer_sqnr_db:.1f} dB ({worst})",
            f"output: SQNR {self.output_sqnr_db:.1f} dB, cosine mean {self.mean_cosine:.5f} "
            f"min {self.min_cosine:.5f}, max |error| {self.max_abs_error:.3g}",
        ]
        return "\n".join(lines)


def fidelity_report(
    float_model: nn.Module,
    quantized_model: nn.Module,
    inputs: Iterable,
    *,
    output_fn: Callable[[object], torch.Tensor] | None = None,
) -> FidelityReport:
    """Compare ``quantized_model`` (from ``quantize``) with ``float_model`` on ``inputs``.

    inputs: an iterable of batches, as ``quantize``'s calibration. Both models run in eval
    mode without grad. output_fn maps a model's output to the tensor to compare (default:
    the tensor itself, ``last_hidden_state``, ``logits`` or the first element).
    Raises ValueError if inputs yields nothing or the models do not have the same
    module names for the quantized layers; TypeError if a model is not an nn.Module.
    """
    _check_module("float_model", float_model)
    _check_module("quantized_model", quantized_model)
    layers = {name: m for name, m in quantized_model.named_modules() if isinstance(m, (Linear8bit, Linear16bit))}
    originals = dict(float_model.named_modules())
    unmatched = sorted(name for name in layers if not isinstance(originals.get(name), nn.Linear))
    if unmatched:
        raise ValueError(f"float_model has no nn.Linear for the quantized layers {unmatched[:5]}")
    output_fn = output_fn or _first_tensor
    energies = {name: [0.0, 0.0] for name in layers}

    def comparer(name):
        def hook(module, args, output):
            exact = output.double()
            actual = layers[name](args[0]).double()
            energies[name][0] += exact.square().sum().item()
            energies[name][1] += (actual - exact).square().sum().item()

        return hook

    handles = [originals[name].register_forward_hook(comparer(name)) for name in layers]
    exact_outputs, actual_outputs = [], []
    try:
        with torch.no_grad(), _EvalMode(float_model), _EvalMode(quantized_model):
            for batch in inputs:
                exact_outputs.append(output_fn(_run(float_model, batch)).double().cpu())
                actual_outputs.append(output_fn(_run(quantized_model, batch)).double().cpu())
    finally:
        for handle in handles:
            handle.remove()
    if not exact_outputs:
        raise ValueError("inputs yielded no batch")

    exact = torch.cat([t.reshape(-1, t.shape[-1]) for t in exact_outputs])
    actual = torch.cat([t.reshape(-1, t.shape[-1]) for t in actual_outputs])
    cosine = torch.nn.functional.cosine_similarity(actual, exact, dim=-1)
    return FidelityReport(
        layer_sqnr_db={name: _decibels(signal, noise) for name, (signal, noise) in energies.items()},
        output_sqnr_db=sqnr_db(actual, exact),
        mean_cosine=cosine.mean().item(),
        min_cosine=cosine.min().item(),
        max_abs_error=(actual - exact).abs().max().item(),
    )
