"""The memory report: what training a model costs, per layer, measured on its device.

``report(model, inputs)`` (``slimformer.memory.report``) measures one
model, or several side by side (a dict of name -> model, all called with the same
inputs), and returns a ``MemoryReport`` that prints as a rich table:

* **parameters**, **gradients** (one per trainable parameter, in its dtype) and
  **AdamW state** (``exp_avg`` and ``exp_avg_sq`` in fp32, 8 bytes per trainable
  parameter; no fp32 master copy), counted from the parameters;
* **activations**: what one forward leaves for backward, by both measurements of
  ``measure_activation_memory`` (saved-tensor hooks, weak references), for the whole
  forward and per layer. A layer's row is its own forward measured alone, on the
  arguments it received inside the model (caught by a forward pre-hook in an extra
  forward whose pack hook keeps nothing). So, as in the memory model of docs/memory-model.md, its
  input, output and parameters are left out, and the row "rest" is the whole forward
  minus its layers: embeddings, the hidden states between layers, heads. Splitting one
  forward by layer instead would need a second pair of saved-tensor hooks inside the
  measurement's, and only the innermost pair runs. A layer that the forward applies
  several times (ALBERT's shared layer) gets one row for all its applications, each
  measured alone on the arguments it received, summed. A HF model with a head around its
  base model (``BertForMaskedLM`` around ``bert``) gets a **head** row too: the whole
  forward minus the base model's forward measured alone the same way, i.e. the head
  and its loss (the masked-LM logits and softmax of eager HF, slimformer's fused
  loss), with the base model's output when the head keeps it;
* the step's **peak**: the most memory allocated at any moment of a forward+backward,
  above what was allocated before it (activations, gradients and temporaries), and of
  the same step followed by AdamW's update (its state allocated by a warm-up step
  before, as in training), measured by ``slimformer.memory.peak_memory``:
  ``torch.cuda.max_memory_allocated`` on CUDA, the CPU allocator's events elsewhere.
  This, not the kept activations, decides whether a run fits. Where the update raises
  the peak above the forward+backward's, the gradients and the update's temporaries set
  it, not the activations, and no recompute policy lowers it: the table says so. The
  update runs with learning rate 0, so the weights stay as they were. On CUDA also the
  median time of a forward+backward.

The layers are the blocks of the model's ``nn.ModuleList`` with the most parameters
(``encoder.layer`` of a HF BERT, ``layers`` of ``nn.TransformerEncoder``) unless named.
Models are measured in the mode they are in: call ``.train()`` for training memory.

``python -m slimformer.memory`` (``slimformer.memory.cli``) prints this report for a HF
BERT, eager vs patched; measuring does not depend on the conversion.
"""

import contextlib
import gc
import io
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from slimformer.memory.measure import ActivationMemory, _tensors, format_bytes, measure_activation_memory
from slimformer.memory.peak import METHODS as PEAK_METHODS, peak_memory

__all__ = [
    "MemoryReport",
    "ModelMemory",
    "activation_sweep",
    "device_name",
    "measure_model",
    "measurement_steps",
    "plot_activation_sweep",
    "progress_bar",
    "report",
    "sweep_title",
]

ADAMW_STATE_BYTES = 8  # exp_avg and exp_avg_sq, fp32, per trainable parameter
_TIMED_STEPS = 5
_TEXT_WIDTH = 1000  # str(report): as wide as the table wants; tables do not expand


def _kept(memory: ActivationMemory) -> int:
    """The larger of the two measurements."""
    return max(memory.saved_bytes, memory.alive_bytes)


@dataclass(frozen=True)
class ModelMemory:
    """One model's training memory in bytes (see the module docstring for each part)."""

    name: str
    device: str
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int  # AdamW: exp_avg + exp_avg_sq in fp32
    activations: ActivationMemory  # the whole forward
    layers: tuple[tuple[str, ActivationMemory], ...]  # (qualified name, the layer measured alone)
    peak_bytes: int | None = None  # forward+backward peak above what was allocated before
    step_seconds: float | None = None  # CUDA: median forward+backward time
    base: tuple[str, ActivationMemory] | None = None  # (name, the base model measured alone) when it has a head
    update_peak_bytes: int | None = None  # the same step followed by AdamW's update; None: no update measured

    @property
    def update_sets_peak(self) -> bool:
        """Whether AdamW's update (gradients + its temporaries) raised the step's peak above
        the forward+backward's, so that activations do not decide it."""
        return None not in (self.update_peak_bytes, self.peak_bytes) and self.update_peak_bytes > self.peak_bytes

    @property
    def activation_bytes(self) -> int:
        """The whole forward's activations, the larger of the two measurements."""
        return _kept(self.activations)

    @property
    def head_bytes(self) -> int | None:
        """Activations of the whole forward outside the base model (head and loss), or None without one."""
        return None if self.base is None else self.activation_bytes - _kept(self.base[1])

    @property
    def rest_bytes(self) -> int:
        """Activations of the whole forward in no layer's row nor the head's (embeddings, hidden states)."""
        return self.activation_bytes - sum(_kept(memory) for _, memory in self.layers) - (self.head_bytes or 0)

    @property
    def training_bytes(self) -> int:
        """Parameters + gradients + AdamW state + activations."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes + self.activation_bytes


@dataclass(frozen=True)
class MemoryReport:
    """Models measured with the same inputs; prints as a table (``print``, ``rich.print``)."""

    models: tuple[ModelMemory, ...]
    title: str = "Training memory"

    def table(self) -> Table:
        """One column per model; rows: parameters, gradients, AdamW state, activations per
        layer (consecutive layers with equal values in every column share a row), rest,
        totals, the step's peak and on CUDA its time."""
        unit_name, unit = _unit(max(m.training_bytes for m in self.models))
        table = Table(title=self.title, caption=self._caption(unit_name), caption_justify="left")
        table.add_column(unit_name, min_width=24)
        for model in self.models:  # "slimformer (none)" heads its column on two lines
            table.add_column(model.name.replace(" ", "\n", 1), justify="right", no_wrap=True)

        def add(label: str, values: Sequence[int | None]) -> None:
            table.add_row(label, *("-" if v is None else f"{v / unit:,.1f}" for v in values))

        add("parameters", [m.parameter_bytes for m in self.models])
        add("gradients", [m.gradient_bytes for m in self.models])
        add("AdamW state", [m.optimizer_bytes for m in self.models])
        table.add_section()
        heads = [m.base[0] for m in self.models if m.base is not None]
        if any(m.layers for m in self.models):
            for label, values in self._layer_rows():
                add(label, values)
        if heads:
            add(f"head + loss (all but {', '.join(sorted(set(heads)))})", [m.head_bytes for m in self.models])
        if any(m.layers for m in self.models):
            add(f"rest (embeddings, layer I/O{'' if heads else ', heads'})", [m.rest_bytes for m in self.models])
        add("activations (saved tensors)", [m.activations.saved_bytes for m in self.models])
        add("activations (alive)", [m.activations.alive_bytes for m in self.models])
        first = self.models[0]
        if len(self.models) > 1 and first.activation_bytes > 0:
            table.add_row(
                f"activations vs {first.name}",
                *(f"{m.activation_bytes / first.activation_bytes:.2f}x" for m in self.models),
            )
        table.add_section()
        add("training total", [m.training_bytes for m in self.models])
        if any(m.peak_bytes is not None for m in self.models):
            add("step peak, fwd+bwd", [m.peak_bytes for m in self.models])
        if any(m.update_peak_bytes is not None for m in self.models):
            add("step peak, fwd+bwd + AdamW update", [m.update_peak_bytes for m in self.models])
            table.add_row("step peak set by", *(_peak_setter(m) for m in self.models))
        if any(m.step_seconds is not None for m in self.models):
            table.add_row(
                "step time, fwd+bwd (ms)",
                *("-" if m.step_seconds is None else f"{m.step_seconds * 1e3:,.2f}" for m in self.models),
            )
        return table

    def _layer_rows(self) -> list[tuple[str, list[int | None]]]:
        count = max(len(m.layers) for m in self.models)
        names = [next(m.layers[i][0] for m in self.models if i < len(m.layers)) for i in range(count)]
        values = [[_kept(m.layers[i][1]) if i < len(m.layers) else None for m in self.models] for i in range(count)]
        rows, start = [], 0
        while start < count:
            end = start
            while end + 1 < count and values[end + 1] == values[start]:
                end += 1
            label = names[start] if end == start else f"{_span(names[start], names[end])}, each"
            rows.append((label, values[start]))
            start = end + 1
        return rows

    def _caption(self, unit_name: str) -> str:
        devices = ", ".join(sorted({m.device for m in self.models}))
        lines = [
            (
                f"{unit_name}, measured on {devices}. Gradients in the parameters' dtype; AdamW state = exp_avg + "
                "exp_avg_sq in fp32 (8 bytes per trainable parameter), no fp32 master copy."
            ),
            (
                "Activations: what the forward leaves for backward, by saved-tensor hooks and by weak references to "
                "live tensors; rows show the larger. A layer row is that layer's forward alone, on the inputs it "
                "gets in the model, its input, output and parameters excluded."
            ),
        ]
        if any(m.base is not None for m in self.models):
            lines.append(
                "Head + loss: the whole forward minus the base model's forward measured alone (its output counts "
                "here when the head keeps it)."
            )
        methods = {PEAK_METHODS[m.device.split(":")[0]] for m in self.models if m.peak_bytes is not None}
        if methods:
            lines.append(
                "Step peak: the most allocated during a forward+backward (after a warm-up step), above what was "
                f"allocated before ({', '.join(sorted(methods))}); then with AdamW's update after it (state allocated "
                "before, learning rate 0). Set by AdamW update: the gradients and the update's temporaries set the "
                "peak, not the activations, and no recompute policy lowers it."
            )
        return "\n".join(lines)

    def __rich__(self) -> Table:
        return self.table()

    def print(self, console: Console | None = None) -> None:
        """Print the table on ``console``; by default on stdout, made wider than the terminal
        where the table would not fit (rather than cutting numbers short)."""
        table = self.table()
        if console is None:
            console = Console()
            needed = console.measure(table, options=console.options.update_width(_TEXT_WIDTH)).maximum
            if needed > console.width:
                console = Console(width=needed)
        console.print(table)

    def __str__(self) -> str:
        console = Console(file=io.StringIO(), width=_TEXT_WIDTH, color_system=None)
        console.print(self.table())
        return console.file.getvalue()


def _peak_setter(model: ModelMemory) -> str:
    if model.update_peak_bytes is None:
        return "-"
    return "AdamW update" if model.update_sets_peak else "fwd+bwd"


def _unit(largest: int) -> tuple[str, int]:
    return ("MiB", 2**20) if largest >= 100 * 2**20 else ("KiB", 2**10)


def _span(first: str, last: str) -> str:
    """``encoder.layer.0`` and ``encoder.layer.11`` -> ``encoder.layer.0–11``."""
    head, _, first_index = first.rpartition(".")
    last_head, _, last_index = last.rpartition(".")
    if head == last_head and first_index.isdigit() and last_index.isdigit():
        return f"{first}–{last_index}"
    return f"{first} … {last}"


def _arguments(inputs: Any) -> tuple[tuple, dict]:
    """(args, kwargs) for ``inputs``: a dict is keyword arguments, a tuple or list positional
    arguments, anything else the one positional argument."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _without_cache(model: nn.Module, kwargs: dict) -> dict:
    """``kwargs`` with ``use_cache=False`` for a forward that takes it and is not told: a
    decoder (Llama, GPT-2 ...) would otherwise fill a KV cache in the forward that catches
    its layers' inputs, and each layer measured alone would attend to that cache too."""
    import inspect

    if "use_cache" in kwargs:
        return kwargs
    try:
        takes = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes = False
    return {**kwargs, "use_cache": False} if takes else kwargs


def _named_layers(model: nn.Module, layers: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    if layers is not None:
        if isinstance(layers, str):
            raise TypeError(f"layers must be a sequence of submodule names, got the string {layers!r}")
        named = dict(model.named_modules())
        missing = [name for name in layers if name not in named]
        if missing:
            raise ValueError(f"layers names no submodule of {type(model).__name__}: {missing}")
        return [(name, named[name]) for name in layers]
    lists = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.ModuleList) and module]
    if not lists:
        return []
    prefix, blocks = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    return [(f"{prefix}.{i}" if prefix else str(i), block) for i, block in enumerate(blocks)]


def _base_model(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(qualified name, module) of a HF model's base model when a head surrounds it, else None."""
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        return None
    return next(((name, module) for name, module in model.named_modules() if module is base), None)


def _discard(_: Any) -> None:
    return None


def _detached(obj: Any) -> Any:
    """``obj`` with each tensor detached, keeping whether it required grad."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().requires_grad_(obj.requires_grad)
    if isinstance(obj, dict):
        return {key: _detached(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        values = [_detached(value) for value in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)  # namedtuple or not
    return obj


def _layer_inputs(model: nn.Module, layers: list[tuple[str, nn.Module]], args: tuple, kwargs: dict) -> list:
    """Per layer, the (args, kwargs) of each of its calls in one forward of ``model`` (one
    call per layer in most models; a shared layer's every application).

    The forward runs with grad enabled, so the inputs say truly whether they require
    grad, but its pack hook keeps nothing, so it costs no activation memory. It also
    warms the model up (lazily built state, kernel compilation) before the measurements.
    """
    captured: dict[nn.Module, list[tuple]] = {}

    def keep(module: nn.Module, layer_args: tuple, layer_kwargs: dict) -> None:
        captured.setdefault(module, []).append(_detached((layer_args, layer_kwargs)))

    handles = [layer.register_forward_pre_hook(keep, with_kwargs=True) for _, layer in layers]
    try:
        with torch.autograd.graph.saved_tensors_hooks(_discard, _discard):
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    not_called = [name for name, layer in layers if layer not in captured]
    if not_called:
        raise ValueError(f"the forward of {type(model).__name__} did not call the layers {not_called}")
    return [captured[layer] for _, layer in layers]


def _summed(memories: list[ActivationMemory]) -> ActivationMemory:
    """What several forwards kept together (one shared layer's applications)."""
    if len(memories) == 1:
        return memories[0]
    return ActivationMemory(
        saved_bytes=sum(m.saved_bytes for m in memories),
        alive_bytes=sum(m.alive_bytes for m in memories),
        saved=tuple(record for m in memories for record in m.saved),
        alive=tuple(record for m in memories for record in m.alive),
    )


def _step(model: nn.Module, args: tuple, kwargs: dict, device: torch.device) -> tuple[int, int | None, float | None]:
    """Peak bytes above the allocation before of forward+backward, and of forward+backward
    followed by AdamW's update (None where no parameter gets a dense gradient); median
    forward+backward seconds on CUDA, else None."""

    def step() -> None:
        outputs = [t for t in _tensors(model(*args, **kwargs)) if t.requires_grad]
        if not outputs:
            raise ValueError(f"no output of {type(model).__name__} requires grad, so there is no backward to measure")
        sum(t.float().sum() for t in outputs).backward()

    model.zero_grad(set_to_none=True)
    step()  # warm-up: backward kernels compile, the allocator fills its cache
    optimizer = _adamw_at_rate_zero(model)
    if optimizer is not None:
        optimizer.step()  # its state exists before the measured step, as in training
    model.zero_grad(set_to_none=True)
    with peak_memory(device) as peak:
        step()
        peak.mark("backward done")
        if optimizer is not None:
            optimizer.step()
    backward_peak = peak.marks[0].top
    update_peak = None if optimizer is None else peak.bytes
    del optimizer  # frees its state
    if device.type != "cuda":
        model.zero_grad(set_to_none=True)
        return backward_peak, update_peak, None
    times = []
    for _ in range(_TIMED_STEPS):
        model.zero_grad(set_to_none=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    model.zero_grad(set_to_none=True)
    return backward_peak, update_peak, statistics.median(times)


def _adamw_at_rate_zero(model: nn.Module) -> torch.optim.AdamW | None:
    """AdamW over the parameters that have a gradient, at learning rate 0: it computes its
    whole update (the same temporaries) and leaves the weights as they are. None where no
    parameter has a gradient or one is sparse (which AdamW refuses)."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    if not parameters or any(p.grad.is_sparse for p in parameters):
        return None
    return torch.optim.AdamW(parameters, lr=0.0)


def measurement_steps(model: nn.Module, layers: Sequence[str] | None = None) -> int:
    """How many times ``measure_model`` calls its ``progress`` for ``model``."""
    return len(_named_layers(model, layers)) + 3 + (_base_model(model) is not None)


def measure_model(
    model: nn.Module,
    inputs: Any,
    *,
    name: str = "model",
    layers: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ModelMemory:
    """Measure one model's training memory (one column of a report) on its device.

    ``inputs`` as for ``report``. Runs one forward to catch the layers' inputs, one per
    layer, one for the whole model, a warm-up and a measured forward+backward step, each
    followed by an AdamW update at learning rate 0 (the weights stay as they are), and
    on CUDA 5 timed forward+backward steps (gradients are set to None after them).
    ``progress``, if given, is called with a description after each of those steps
    (``measurement_steps(model)`` times), e.g. a progress bar's update.
    """
    args, kwargs = _arguments(inputs)
    kwargs = _without_cache(model, kwargs)
    named = _named_layers(model, layers)
    parameters = list(model.parameters())
    trainable = [p for p in parameters if p.requires_grad]
    device = parameters[0].device if parameters else torch.device("cpu")

    def done(step: str) -> None:
        if progress is not None:
            progress(f"{name}: {step}")

    base = _base_model(model)
    layer_inputs = _layer_inputs(model, named + ([base] if base else []), args, kwargs)
    done("layer inputs caught")
    per_layer = []
    for (layer_name, layer), calls in zip(named, layer_inputs):
        memories = [measure_activation_memory(layer, *layer_args, **layer_kwargs) for layer_args, layer_kwargs in calls]
        label = layer_name if len(calls) == 1 else f"{layer_name} (applied {len(calls)}×)"
        per_layer.append((label, _summed(memories)))
        done(f"{layer_name} measured")
    base_memory = None
    if base is not None:
        base_args, base_kwargs = layer_inputs[-1][0]
        base_memory = (base[0], measure_activation_memory(base[1], *base_args, **base_kwargs))
        done(f"{base[0]} measured alone")
    peak, update_peak, seconds = _step(model, args, kwargs, device)
    done("training steps measured")
    activations = measure_activation_memory(model, *args, **kwargs)
    done("whole forward measured")
    return ModelMemory(
        name=name,
        device=str(device),
        parameter_bytes=sum(p.numel() * p.element_size() for p in parameters),
        gradient_bytes=sum(p.numel() * p.element_size() for p in trainable),
        optimizer_bytes=sum(p.numel() for p in trainable) * ADAMW_STATE_BYTES,
        activations=activations,
        layers=tuple(per_layer),
        peak_bytes=peak,
        step_seconds=seconds,
        base=base_memory,
        update_peak_bytes=update_peak,
    )


def report(
    model: nn.Module | Mapping[str, nn.Module],
    inputs: Any,
    *,
    layers: Sequence[str] | None = None,
    title: str | None = None,
    progress: bool = True,
) -> MemoryReport:
    """Measure the training memory of ``model``, or of several models side by side.

    ``model``: a module, or a dict of column name -> module (e.g. ``{"eager": hf_model,
    "slimformer": sf.patch(copy.deepcopy(hf_model))}``); each is measured on the device
    of its parameters, in the mode it is in, one after the other.
    ``inputs``: what each model is called with: a dict (keyword arguments, e.g. a
    tokenizer's output), a tuple or list (positional arguments) or one tensor.
    ``layers``: qualified names of the submodules to give a row each; by default the
    blocks of the ``nn.ModuleList`` holding the most parameters.

    Returns a ``MemoryReport``: ``print(report(...))`` (or ``.print()``) shows the table,
    its ``models`` hold the numbers (``ModelMemory``). Each model runs about three
    forwards and two or more forward+backward steps with two AdamW updates at learning
    rate 0 (see ``measure_model``), after which its weights are unchanged and its
    gradients None. ``progress`` shows a tqdm bar on stderr (one step per layer).
    """
    models = dict(model) if isinstance(model, Mapping) else {"model": model}
    if not models:
        raise ValueError("model must be a module or a non-empty dict of name -> module, got an empty dict")
    with progress_bar(models, layers, enabled=progress) as step:
        measured = tuple(
            measure_model(module, inputs, name=name, layers=layers, progress=step) for name, module in models.items()
        )
    devices = ", ".join(sorted({m.device for m in measured}))
    return MemoryReport(measured, title or f"Training memory on {devices}")


@contextlib.contextmanager
def progress_bar(models: Mapping[str, nn.Module], layers: Sequence[str] | None = None, *, enabled: bool = True):
    """A tqdm bar over every ``measure_model`` step of ``models``; yields its ``progress`` callback.

    The bar goes to stderr, and to a log file too (one line per update at most every
    10 s there), so a long CPU measurement is never silent."""
    from tqdm.auto import tqdm

    total = sum(measurement_steps(module, layers) for module in models.values())
    with tqdm(total=total, desc="memory report", unit="step", disable=not enabled, mininterval=1.0) as bar:

        def step(description: str) -> None:
            bar.set_postfix_str(description, refresh=False)
            bar.update()

        yield step


def activation_sweep(
    variants: Mapping[str, Callable[[], nn.Module]],
    make_inputs: Callable[[int], Any],
    seqs: Sequence[int],
    *,
    log: Callable[[str], None] | None = None,
) -> dict[str, list[int | None]]:
    """Activation bytes of one whole forward (the larger measurement) per variant and sequence.

    ``variants`` maps a name to a function that readies and returns the model (sets a
    policy, say); ``make_inputs(seq)`` gives the inputs (as for ``report``). Each variant is
    warmed up by one forward that keeps nothing before its first measurement. A variant
    that runs out of memory gets None at that length and every longer one.
    """
    sweep: dict[str, list[int | None]] = {name: [] for name in variants}
    for seq in seqs:
        args, kwargs = _arguments(make_inputs(seq))
        for name, ready in variants.items():
            if sweep[name] and sweep[name][-1] is None:
                sweep[name].append(None)
                continue
            model = ready()
            try:
                if not sweep[name]:
                    with torch.autograd.graph.saved_tensors_hooks(_discard, _discard):
                        model(*args, **kwargs)
                kept = _kept(measure_activation_memory(model, *args, **kwargs))
            except torch.OutOfMemoryError:
                kept = None
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            sweep[name].append(kept)
            if log is not None:
                log(f"seq {seq:>5}  {name:<22} " + ("out of memory" if kept is None else format_bytes(kept)))
    return sweep


_MARKERS = "osD^vP*Xh"


def plot_activation_sweep(
    sweep: Mapping[str, Sequence[int | None]], seqs: Sequence[int], path: str | Path, *, title: str
) -> None:
    """Write a PNG of ``activation_sweep``'s result: MiB vs sequence length, log-log, one line each.

    Lines that coincide (eager and SDPA keep the same on a CPU) stay visible: each has
    its own marker, the earlier ones larger and hollow beneath the later ones, and the
    baselines (names without "slimformer") are dashed."""
    from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone

    figure = Figure(figsize=(8, 5), layout="constrained")
    axes = figure.subplots()
    count = len(sweep)
    for index, (name, values) in enumerate(sweep.items()):
        points = [(seq, kept / 2**20) for seq, kept in zip(seqs, values) if kept is not None]
        style = {
            "marker": _MARKERS[index % len(_MARKERS)],
            "markersize": 5 + 2.5 * (count - 1 - index) / max(count - 1, 1) * 2,
            "markerfacecolor": "none" if index < count - 1 else None,
            "linestyle": "--" if "slimformer" not in name else "-",
            "linewidth": 1.5,
            "color": f"C{index % 10}",
            "zorder": 2 + index,
        }
        if not points:
            axes.plot([], [], label=f"{name} (out of memory)", **style)
            continue
        label = name if len(points) == len(seqs) else f"{name} (out of memory after seq {points[-1][0]})"
        axes.plot(*zip(*points), label=label, **style)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(list(seqs), [str(seq) for seq in seqs])
    axes.minorticks_off()
    axes.set_xlabel("sequence length")
    axes.set_ylabel("activations kept for backward (MiB)")
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=120)


def sweep_title(model: str, batch: int, dtype: torch.dtype, dropout: float, device: torch.device) -> str:
    """The plot title: what was measured, where, and on which code path."""
    path = "slimformer layers on the PyTorch reference path (CPU)" if device.type == "cpu" else "Triton kernels"
    dtype_name = str(dtype).removeprefix("torch.")
    return f"{model}, batch {batch}, {dtype_name}, dropout {dropout:g}, training mode\n{device_name(device)}: {path}"


def device_name(device: torch.device) -> str:
    """The GPU's name for a CUDA device, else the device as torch writes it ("cpu")."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return str(device)
