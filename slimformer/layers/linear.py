"""Inference linears on the GEMM kernels: int8 weights (W8A8 or weight-only) and 16-bit.

``Linear8bit`` stores an nn.Linear's weight as int8 with one fp32 scale per output
channel (``quantize_per_channel``), so its weight takes a quarter of its fp32 bytes:

- ``mode="int8"`` (W8A8, dynamic): each call quantizes the input per token and runs
  the int8 GEMM with int32 accumulation; ``smooth`` (K,), set by SmoothQuant
  calibration, multiplies the input before quantization (the weight was divided by it
  before being quantized, so the product is unchanged); an empty ``smooth`` (0,) means
  the input is not smoothed.
- ``mode="int8-weight-only"`` (W8A16): the input stays in its float dtype and the
  weight is dequantized inside the GEMM (on GPU). On a CPU with VNNI or AMX the same op
  is rounded differently: the input is rounded per token to 16-bit fixed point
  (``round(x / s)``, ``s = max|x| / 32639``, 15 bits of the row's max, finer than the
  GPU's fp16/bf16 activations) and multiplied exactly in int32 as two int8 halves in one
  int8 GEMM (``slimformer.kernels.matmul``), which is faster than the fp32 GEMM there; on
  other CPUs the fp32 input is multiplied by the weight converted to fp32.

``Linear16bit`` keeps the weight in float16 or bfloat16 and runs the fp32-accumulating
GEMM. Every layer casts nothing but its own arithmetic: the output has the input's
dtype, so the layers drop into a float model whose other modules stay as they are.

state_dict: ``weight`` (int8 or 16-bit), ``weight_scale`` (int8 modes), ``smooth``
(fp32, (K,) or empty; mode "int8", whose mark it is) and ``bias`` (if any), all plain
tensors (safetensors-friendly). ``weight_scale`` is an fp32 buffer whose values
``quantize_per_channel`` makes bfloat16 values, so the state_dict holds it in bfloat16
(exactly; fp32 where a loaded scale is not a bfloat16 value) and loading takes either.
Scales, ``smooth`` and the 16-bit weight keep their dtype under ``model.half()`` /
``.to(dtype)``; only their device follows. Loading a state_dict saved from a layer of
another mode is an error. These are inference layers: backward raises RuntimeError.

``quantized_state(name, tensor)`` turns one float tensor of the nn.Linear a layer
replaces into the layer's state_dict entries; ``from_float`` and transformers'
quantize-on-load (``slimformer.integrations.hf.quantizer``) both go through it, so the two
give the same bits.
"""

import torch
from torch import nn

from slimformer.kernels import int8_cpu
from slimformer.kernels.matmul import (
    FLOAT_DTYPES,
    MAX_INT8_IN_FEATURES,
    int8_linear,
    int8_linear_unchecked,
    int8_weight_only_linear,
    int8_weight_only_linear_unchecked,
    linear,
    quantize_per_channel,
)

INT8_MODES = ("int8", "int8-weight-only")
FLOAT16_MODES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def state_dict_mode(state_dict, prefix: str = "") -> str | None:
    """The mode of the linear saved under ``prefix`` in ``state_dict``.

    "int8" or "int8-weight-only" (int8 weight, with or without ``smooth``), "fp16" or
    "bf16" (16-bit weight), "float" (an unquantized nn.Linear), None when there is no
    ``prefix + "weight"``.
    """
    weight = state_dict.get(prefix + "weight")
    if weight is None:
        return None
    if weight.dtype == torch.int8:
        return "int8" if prefix + "smooth" in state_dict else "int8-weight-only"
    modes = {dtype: mode for mode, dtype in FLOAT16_MODES.items()}
    return modes.get(weight.dtype, "float")


def _check_linear(linear) -> None:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")


def _forget_packing(layer: nn.Module) -> None:
    """Drop the CPU int8 GEMM's packing of ``layer``'s weight before the weight is replaced:
    ``torch.utils.swap_tensors`` (load_state_dict and .to under swap mode) refuses a tensor
    with a weak reference, which the packing cache holds."""
    weight = layer._buffers.get("weight")
    if weight is not None:
        int8_cpu.forget_packing(weight)


class _InferenceLinear(nn.Module):
    """What both layers share: sizes, the mode check on load, dtype-stable buffers, the repr."""

    # Buffers whose dtype is part of the format: dtype casts of the module move them only.
    _fixed_dtype_buffers: tuple[str, ...] = ()
    # state_dict entries that load without loss from several dtypes: {name: dtypes}.
    loadable_dtypes: dict[str, tuple[torch.dtype, ...]] = {}
    mode: str

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features

    def _apply(self, fn, recurse=True):
        _forget_packing(self)
        before = {name: self._buffers[name] for name in self._fixed_dtype_buffers if name in self._buffers}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        saved = state_dict_mode(state_dict, prefix)
        if saved is not None and saved != self.mode:
            error_msgs.append(
                f"{prefix + 'weight'} was saved from a {saved!r} layer, but this layer is {self.mode!r}: "
                f"quantize the model with mode {saved!r} before loading it"
            )
            return
        _forget_packing(self)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, mode={self.mode!r}"
        )

    def _check_state_name(self, name: str) -> None:
        names = ("weight", "bias") if self.bias is not None else ("weight",)
        if name not in names:
            raise ValueError(f"name must be one of {names}, got {name!r}")

    @staticmethod
    def _converted(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        converted = tensor.detach().to(dtype, copy=True)
        if not bool(torch.isfinite(converted).all()):
            raise ValueError(f"linear.{name} must be finite in {dtype} to convert, got NaN or infinity")
        return converted


class Linear8bit(_InferenceLinear):
    """nn.Linear with an int8 weight and per-output-channel fp32 scales; see the module docstring.

    Constructor: the sizes of nn.Linear, ``mode`` ("int8" or "int8-weight-only"),
    ``dtype`` for the bias (default float32) and ``smoothed`` (mode "int8": ``smooth``
    is (in_features,), all ones until set, instead of empty). The weight starts at zero:
    build it with ``from_float`` or load a state_dict. forward: input (..., in_features)
    float32, float16 or bfloat16 -> (..., out_features) in the same dtype.
    """

    _fixed_dtype_buffers = ("weight_scale", "smooth")
    loadable_dtypes = {"weight_scale": (torch.bfloat16, torch.float32)}

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        mode: str = "int8",
        smoothed: bool = False,
    ) -> None:
        if mode not in INT8_MODES:
            raise ValueError(f"mode must be one of {INT8_MODES}, got {mode!r}")
        if smoothed and mode != "int8":
            raise ValueError(f"smoothed applies to mode 'int8' only, got mode {mode!r}")
        super().__init__(in_features, out_features)
        self.mode = mode
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        if mode == "int8":
            smooth_features = in_features if smoothed else 0
            self.register_buffer("smooth", torch.ones(smooth_features, dtype=torch.float32, device=device))
            self._smooth_key = None
        bias_tensor = torch.zeros(out_features, dtype=dtype or torch.float32, device=device) if bias else None
        self.register_buffer("bias", bias_tensor)

    @classmethod
    def from_float(cls, linear: nn.Linear, mode: str = "int8", *, smooth: torch.Tensor | None = None):
        """The quantized copy of ``linear`` (same device; bias kept in its dtype).

        smooth: (in_features,) positive SmoothQuant multipliers of the input (mode "int8"
        only): the weight is divided by them per input channel before quantization.
        Raises TypeError if linear is not an nn.Linear, ValueError on a bad mode or
        smooth, or a weight or bias with NaN/infinity.
        """
        _check_linear(linear)
        if mode not in INT8_MODES:
            raise ValueError(f"mode must be one of {INT8_MODES}, got {mode!r}")
        device = linear.weight.device
        if smooth is not None:
            if mode != "int8":
                raise ValueError(f"smooth applies to mode 'int8' only, got mode {mode!r}")
            if tuple(smooth.shape) != (linear.in_features,):
                raise ValueError(f"smooth must have shape [{linear.in_features}], got {list(smooth.shape)}")
            if not bool((torch.isfinite(smooth) & (smooth > 0)).all()):
                raise ValueError("smooth must be finite and positive")
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device=device,
            dtype=None if linear.bias is None else linear.bias.dtype,
            mode=mode,
            smoothed=smooth is not None,
        )
        if smooth is not None:
            layer.smooth = smooth.to(device, torch.float32, copy=True)
        state = {} if linear.bias is None else layer.quantized_state("bias", linear.bias)
        state.update(layer.quantized_state("weight", linear.weight))
        if device.type == "cpu":
            int8_cpu.extension()  # built (or found in the cache) now rather than in the first forward
        for name, tensor in state.items():
            setattr(layer, name, tensor)
        return layer

    def quantized_state(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """This layer's state_dict entries for ``tensor``, the float ``name`` ("weight" or
        "bias") of the nn.Linear it replaces: the weight divided by ``smooth`` (if set) and
        quantized (``weight``, ``weight_scale`` and, mode "int8", ``smooth``), or the bias
        in the layer's dtype; on ``tensor``'s device. Raises ValueError on another name or a
        tensor with NaN or infinity."""
        self._check_state_name(name)
        if name == "bias":
            return {"bias": self._converted("bias", tensor, self.bias.dtype)}
        weight = tensor.detach()
        smooth = self._buffers.get("smooth")
        if smooth is not None and smooth.numel():
            weight = weight.float() / smooth.to(weight.device, torch.float32)
        q, scale = quantize_per_channel(weight)
        state = {"weight": q, "weight_scale": scale}
        if smooth is not None:
            state["smooth"] = smooth if smooth.numel() else torch.ones(0, device=weight.device)
        return state

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        scale = destination[prefix + "weight_scale"]
        if scale.is_meta:  # a skeleton (transformers builds one before loading) has no values to compare
            return
        as_bfloat16 = scale.detach().to(torch.bfloat16)
        if torch.equal(as_bfloat16.float(), scale.detach()):
            destination[prefix + "weight_scale"] = as_bfloat16

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        # ``smooth`` is (K,) for a smoothed layer, empty otherwise: take the saved one's length.
        saved_smooth = state_dict.get(prefix + "smooth")
        own = self._buffers.get("smooth")
        if own is not None and saved_smooth is not None and saved_smooth.shape in ((0,), (self.in_features,)):
            self._buffers["smooth"] = torch.empty(saved_smooth.shape, dtype=own.dtype, device=own.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Buffers read from _buffers: nn.Module.__getattr__ searches three dicts per read,
        # a cost on a small CPU Linear's path.
        buffers = self._buffers
        weight, weight_scale, bias = buffers["weight"], buffers["weight_scale"], buffers["bias"]
        plain = self._is_plain_inference_input(input, weight)
        if self.mode == "int8-weight-only":
            if not plain:
                return int8_weight_only_linear(input, weight, weight_scale, bias)
            return int8_weight_only_linear_unchecked(input, weight, weight_scale, bias)
        smooth = self._applied_smooth(buffers["smooth"])
        if not plain:
            return int8_linear(input, weight, weight_scale, bias, smooth=smooth)
        return int8_linear_unchecked(input, weight, weight_scale, bias, smooth)

    def _is_plain_inference_input(self, input, weight) -> bool:
        """Whether ``input`` needs none of the checked ops' checks (their errors, their backward
        that raises): a float (..., in_features) tensor on the weight's device, no autograd."""
        return (
            isinstance(input, torch.Tensor)
            and input.dtype in FLOAT_DTYPES
            and input.dim() >= 1
            and input.shape[-1] == self.in_features <= MAX_INT8_IN_FEATURES
            and ((input.is_cpu and weight.is_cpu) or input.device == weight.device)
            and not (input.requires_grad and torch.is_grad_enabled())
        )

    def _applied_smooth(self, smooth: torch.Tensor) -> torch.Tensor | None:
        """``smooth`` (the buffer), or None while it is empty or all ones (no calibration):
        multiplying by ones is an extra pass over the input for nothing. The check reruns
        only when the buffer is replaced or written in place (``load_state_dict``, ``.to``);
        under torch.compile the buffer whenever it is not empty."""
        if torch.compiler.is_compiling():
            # no host read of the buffer in a graph: multiplying by ones changes no bit
            return smooth if smooth.numel() else None
        key = (smooth.data_ptr(), smooth.is_cpu, None if smooth.is_inference() else smooth._version, smooth.numel())
        if self._smooth_key != key:
            self._smooth_is_one = bool((smooth == 1).all())
            self._smooth_key = key
        return None if self._smooth_is_one else smooth

    def dequantized_weight(self) -> torch.Tensor:
        """The (out_features, in_features) fp32 weight this layer multiplies by, smoothing undone."""
        weight = self.weight.float() * self.weight_scale[:, None]
        return weight * self.smooth if self.mode == "int8" and self.smooth.numel() else weight


class Linear16bit(_InferenceLinear):
    """nn.Linear with its weight and bias in float16 or bfloat16, on the fused GEMM kernel.

    Constructor: the sizes of nn.Linear and ``dtype`` (torch.float16 or torch.bfloat16).
    forward: input (..., in_features) in any float dtype is cast to the layer's dtype,
    multiplied with fp32 accumulation, and returned in the input's dtype.
    """

    _fixed_dtype_buffers = ("weight",)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=torch.float16,
    ) -> None:
        modes = {d: mode for mode, d in FLOAT16_MODES.items()}
        if dtype not in modes:
            raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        super().__init__(in_features, out_features)
        self.mode = modes[dtype]
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_float(cls, linear: nn.Linear, dtype: torch.dtype = torch.float16):
        """The 16-bit copy of ``linear`` (same device). Raises TypeError on a bad linear or dtype,
        ValueError if a weight or bias does not fit in ``dtype`` (NaN, infinity or overflow)."""
        _check_linear(linear)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.device, dtype)
        names = ("weight",) if linear.bias is None else ("weight", "bias")
        state = {k: v for name in names for k, v in layer.quantized_state(name, getattr(linear, name)).items()}
        for name, tensor in state.items():
            setattr(layer, name, tensor)
        return layer

    def quantized_state(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """{name: tensor in the layer's dtype} for the float ``name`` ("weight" or "bias") of
        the nn.Linear it replaces. Raises ValueError on another name or a tensor that is not
        finite in the layer's dtype."""
        self._check_state_name(name)
        return {name: self._converted(name, tensor, self.weight.dtype)}

    def dequantized_weight(self) -> torch.Tensor:
        """The (out_features, in_features) weight in fp32."""
        return self.weight.float()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input, torch.Tensor) or input.dtype not in FLOAT_DTYPES:
            got = input.dtype if isinstance(input, torch.Tensor) else type(input).__name__
            raise TypeError(f"input must be a float32, float16 or bfloat16 tensor, got {got}")
        return linear(input.to(self.weight.dtype), self.weight, self.bias).to(input.dtype)
