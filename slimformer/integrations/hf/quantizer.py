"""slimformer's quantization as a transformers (>= 5) quantization method, "slimformer".

Importing this module registers ``SlimformerInt8Config`` and ``SlimformerHfQuantizer``
with transformers (``register_quantization_config`` / ``register_quantizer``), so that

- ``AutoModel.from_pretrained(float_dir, quantization_config=SlimformerInt8Config("int8"))``
  quantizes on load, to the same bits as ``slimformer.quantize`` of the float model;
- ``model.save_pretrained(dir)`` writes the quantized state_dict (int8 weights, bfloat16
  scales, SmoothQuant factors; as ``save_quantized``, but each int8 weight flattened to
  (out_features · in_features,), ``checkpoint_format`` 2) and, in config.json's
  ``quantization_config``, the record of which module has which mode;
- ``AutoModel.from_pretrained(dir)`` reloads it without a float copy of any quantized
  Linear: transformers builds the model on the meta device, the recorded nn.Linears are
  swapped for empty ``Linear8bit`` / ``Linear16bit`` there (``smooth`` sized for the
  layers that have one), and the saved tensors load straight into them.

Quantizing on load swaps the Linears the config's rule picks (``mode``,
``modules_to_not_convert``, plus the model's tied and keep-in-fp32 modules) on the
meta device too; transformers then reads one float weight at a time and hands it to
``_QuantizeOnLoad``, which stores the layer's ``quantized_state`` of it (the function
``from_float`` uses). A model that ``slimformer.quantize`` or ``load_quantized``
converted gets the same record (``record_quantization``), so its ``save_pretrained``
works the same way.

Memory: loading a saved int8 model holds the int8 model and little else. Quantizing on
load peaks above a float load: transformers maps the whole float file, and every page
of it that was read stays resident until the load ends; save the quantized model once
and load that.

transformers only knows "slimformer" once this module is imported (``import slimformer``
does it). Without it, transformers warns "Unknown quantization type, got slimformer",
skips the quantization and builds the float model, which would take int8 values into its
float Linears (an int8 weight loads into a float one of the same shape). The flat int8
weights prevent that: their shape is no float Linear's, so the load report lists them as
mismatched and ``from_pretrained`` raises RuntimeError (unless called with
``ignore_mismatched_sizes=True``, which initializes those Linears afresh, as the report
says). A checkpoint whose quantized layers are all 16-bit holds float weights of the
Linears' shapes, which load into float Linears as the values they are. Records written before
``checkpoint_format`` existed (format 1: int8 weights (out, in)) still load with slimformer.
"""

import copy
from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.quantizers_utils import get_module_from_name
from transformers.utils.quantization_config import QuantizationConfigMixin

from slimformer.layers.linear import FLOAT16_MODES, Linear8bit, Linear16bit
from slimformer.quantize import (
    DEFAULT_SKIP,
    MODES,
    TRANSFORMERS_CHECKPOINT_FORMAT,
    TRANSFORMERS_QUANT_METHOD,
    checked_checkpoint_format,
    checked_modes,
    linears_to_convert,
    quantized_modules,
    recorded_conversions,
    swap_modules,
)

__all__ = ["SlimformerHfQuantizer", "SlimformerInt8Config"]

_QUANTIZED = (Linear8bit, Linear16bit)


@register_quantization_config(TRANSFORMERS_QUANT_METHOD)
class SlimformerInt8Config(QuantizationConfigMixin):
    """The ``quantization_config`` of a slimformer-quantized transformers model.

    mode: "int8", "int8-weight-only", "fp16" or "bf16", as ``slimformer.quantize``.
    modules_to_not_convert: names of the nn.Linears left float, matched as ``quantize``'s
        ``skip`` (equal, a prefix up to a ".", or a dotted part). Default: the heads
        (``slimformer.quantize.DEFAULT_SKIP``).
    modules: the record {module name: mode} of a quantized model, written when it is
        saved; loading converts exactly these (``mode`` and ``modules_to_not_convert``
        then only tell how they were chosen). None: the rule above decides.
    smoothed_modules: the "int8" modules of the record that carry SmoothQuant factors
        (``quantize(..., calibration=...)``; calibration cannot run inside a load).
    checkpoint_format: how a saved record's int8 weights are laid out
        (``slimformer.quantize.TRANSFORMERS_CHECKPOINT_FORMATS``): 2, flattened, as
        ``save_pretrained`` writes them now (the default); 1, (out, in), a record that has
        none (``from_dict``), written before the flat layout.

    Raises ValueError on an unknown mode, quant_method or checkpoint_format, a bad record,
    or smoothed modules outside the record's "int8" ones; TypeError if
    modules_to_not_convert is not a sequence of names.
    """

    def __init__(
        self,
        mode: str = "int8",
        modules_to_not_convert: Sequence[str] = DEFAULT_SKIP,
        modules: dict[str, str] | None = None,
        smoothed_modules: Sequence[str] = (),
        quant_method: str = TRANSFORMERS_QUANT_METHOD,
        checkpoint_format: int = TRANSFORMERS_CHECKPOINT_FORMAT,
    ) -> None:
        if quant_method != TRANSFORMERS_QUANT_METHOD:
            raise ValueError(f"quant_method must be {TRANSFORMERS_QUANT_METHOD!r}, got {quant_method!r}")
        checked_checkpoint_format(checkpoint_format, "SlimformerInt8Config")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        _check_names("modules_to_not_convert", modules_to_not_convert)
        _check_names("smoothed_modules", smoothed_modules)
        if modules is not None:
            checked_modes(modules, "SlimformerInt8Config")
        not_int8 = sorted(name for name in smoothed_modules if (modules or {}).get(name) != "int8")
        if not_int8:
            raise ValueError(f"smoothed_modules must be 'int8' modules of the record (modules), got {not_int8[:5]}")
        self.quant_method = TRANSFORMERS_QUANT_METHOD
        self.mode = mode
        self.modules_to_not_convert = list(modules_to_not_convert)
        self.modules = None if modules is None else dict(modules)
        self.smoothed_modules = sorted(smoothed_modules)
        self.checkpoint_format = checkpoint_format

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        """The config of a dict (config.json's ``quantization_config``); a record without
        ``checkpoint_format`` has format 1, the layout written before the field existed."""
        config_dict = {"checkpoint_format": 1, **config_dict}
        return super().from_dict(config_dict, return_unused_kwargs=return_unused_kwargs, **kwargs)


def _check_names(name: str, value) -> None:
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{name} must be a sequence of module names, got {value!r:.80}")


@register_quantizer(TRANSFORMERS_QUANT_METHOD)
class SlimformerHfQuantizer(HfQuantizer):
    """transformers' side of the method: swaps the Linears on the meta skeleton before the
    weights load, and quantizes float weights as they load. Keeps a copy of the config,
    so the record it writes after loading stays with this model."""

    requires_calibration = False

    def __init__(self, quantization_config: SlimformerInt8Config, **kwargs) -> None:
        if not isinstance(quantization_config, SlimformerInt8Config):
            raise TypeError(
                f"quantization_config must be a SlimformerInt8Config, got {type(quantization_config).__name__}"
            )
        super().__init__(copy.deepcopy(quantization_config), **kwargs)

    def _process_model_before_weight_loading(self, model, **kwargs):
        config = self.quantization_config
        if config.modules is not None:
            modes, aliases = recorded_conversions(model, config.modules, "quantization_config")
        else:
            skip = [*config.modules_to_not_convert, *_modules_to_keep_float(model)]
            linears, aliases = linears_to_convert(model, skip)
            if not linears:
                raise ValueError(f"model has no torch.nn.Linear left to quantize (modules_to_not_convert={skip})")
            modes = dict.fromkeys(linears, config.mode)
        smoothed = set(config.smoothed_modules)
        flat = self.pre_quantized and config.checkpoint_format >= 2
        skeletons = {
            first: _skeleton(
                model.get_submodule(first), mode, smoothed=not smoothed.isdisjoint(aliases[first]), flat=flat
            )
            for first, mode in modes.items()
        }
        swap_modules(model, {alias: skeletons[first] for first in skeletons for alias in aliases[first]})
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        module, name = get_module_from_name(model, param_name)
        return isinstance(module, _QUANTIZED) and name in ("weight", "bias")

    def get_quantize_ops(self):
        return _QuantizeOnLoad()

    def _process_model_after_weight_loading(self, model, **kwargs):
        for layer in model.modules():
            if isinstance(layer, Linear8bit) and layer.weight.dim() == 1:  # loaded flat (checkpoint_format 2)
                layer.weight = layer.weight.view(layer.out_features, layer.in_features)
        _write_record(self.quantization_config, model)
        return model

    def get_state_dict_and_metadata(self, model):
        """The state_dict ``save_pretrained`` writes: the model's, each int8 weight flattened
        (``checkpoint_format`` 2), which replaces a ``state_dict=`` given to it, as for
        transformers' other quantizers. Refuses a quantized tied Linear."""
        tied = [name for name in _tied_linears(model) if isinstance(model.get_submodule(name), _QUANTIZED)]
        if tied:
            raise ValueError(
                f"{tied} share a tensor with another module (tied weights), which transformers ties again "
                "on load, so their quantized copies cannot be saved: quantize with them skipped (skip=, "
                "modules_to_not_convert=; slimformer's default skips the heads)"
            )
        state = model.state_dict()
        for name, layer in model.named_modules(remove_duplicate=False):
            if isinstance(layer, Linear8bit) and f"{name}.weight" in state:
                state[f"{name}.weight"] = state[f"{name}.weight"].reshape(-1)
        model.config.quantization_config.checkpoint_format = TRANSFORMERS_CHECKPOINT_FORMAT
        return state, {}

    def _dequantize(self, model, dtype=None):
        """Swap every slimformer layer back for an nn.Linear of its dequantized weight (smoothing undone)."""
        dtype = dtype or torch.get_default_dtype()
        floats = {layer: _float_linear(layer, dtype) for layer in model.modules() if isinstance(layer, _QUANTIZED)}
        names = model.named_modules(remove_duplicate=False)
        swap_modules(model, {name: floats[layer] for name, layer in names if layer in floats})
        return model

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False  # slimformer's layers are for inference: their backward raises


class _QuantizeOnLoad(ConversionOps):
    """One float tensor of a swapped Linear, as transformers reads it, into that layer's state."""

    def convert(self, input_dict, model=None, **kwargs) -> dict[str, torch.Tensor]:
        state = {}
        for key, tensors in input_dict.items():
            (tensor,) = tensors if isinstance(tensors, list) else (tensors,)
            module_name, _, name = key.rpartition(".")
            try:
                converted = model.get_submodule(module_name).quantized_state(name, tensor)
            except ValueError as error:
                raise ValueError(f"cannot quantize {module_name!r}: {error}") from error
            state.update({f"{module_name}.{k}": v for k, v in converted.items()})
        return state


def _modules_to_keep_float(model) -> list[str]:
    """The model's keep-in-fp32 modules and its tied Linears."""
    names = set(_tied_linears(model))
    for attribute in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        names.update(getattr(model, attribute, None) or ())
    return sorted(names)


def _tied_linears(model) -> list[str]:
    """The Linears (float or slimformer's) whose weight or bias is tied to another tensor:
    transformers ties them again on load, which a quantized copy cannot follow."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    names = {key.rpartition(".")[0] for pair in tied.items() for key in pair}
    return sorted(name for name in names if isinstance(model.get_submodule(name), (nn.Linear, *_QUANTIZED)))


def _skeleton(linear: nn.Linear, mode: str, *, smoothed: bool, flat: bool) -> nn.Module:
    """The empty layer of ``mode`` for ``linear``, on its device (meta, in a transformers load);
    ``flat``: an int8 layer's weight (out * in,), as checkpoint_format 2 saves it, until loaded."""
    sizes = (linear.in_features, linear.out_features, linear.bias is not None, linear.weight.device)
    if mode in FLOAT16_MODES:
        return Linear16bit(*sizes, FLOAT16_MODES[mode])
    bias_dtype = None if linear.bias is None else linear.bias.dtype
    layer = Linear8bit(*sizes, bias_dtype, mode=mode, smoothed=smoothed)
    if flat:
        layer.weight = layer.weight.reshape(-1)
    return layer


def _float_linear(layer: nn.Module, dtype: torch.dtype) -> nn.Linear:
    weight = layer.dequantized_weight()
    linear = nn.Linear(layer.in_features, layer.out_features, layer.bias is not None, weight.device, dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if layer.bias is not None:
            linear.bias.copy_(layer.bias)
    return linear


def _write_record(config: SlimformerInt8Config, model: nn.Module) -> None:
    config.checkpoint_format = TRANSFORMERS_CHECKPOINT_FORMAT
    config.modules = quantized_modules(model)
    config.smoothed_modules = sorted(
        name
        for name, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, Linear8bit) and m.mode == "int8" and m.smooth.numel()
    )


def record_quantization(model) -> None:
    """Give a transformers ``PreTrainedModel`` that slimformer converted outside
    ``from_pretrained`` (``slimformer.quantize``, ``load_quantized``) the quantizer and
    ``config.quantization_config`` that ``save_pretrained`` writes, describing the model
    as it is now (a model loaded quantized keeps its quantizer, with the new config).
    ``quantize`` and ``load_quantized`` call this."""
    modes = Counter(quantized_modules(model).values())
    left_float = [name for name, m in model.named_modules(remove_duplicate=False) if type(m) is nn.Linear]
    config = SlimformerInt8Config(modes.most_common(1)[0][0], modules_to_not_convert=left_float)
    _write_record(config, model)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        model.hf_quantizer = quantizer = SlimformerHfQuantizer(config, pre_quantized=True)
    quantizer.quantization_config = model.config.quantization_config = config
