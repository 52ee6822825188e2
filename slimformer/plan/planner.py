"""``sf.plan``: the per-layer recompute policies that fit a training step in a memory
budget at the least extra compute, with the predicted step peak and what it is made of.

How a plan is chosen, monotonic by construction:

1. ``measure``: the model's step is measured at 1, 2 and 4 rows of the example batch
   under every policy (``slimformer.plan.profile``), on the model itself (patched in place by
   ``sf.patch`` for the measurement and unpatched after, if it was not patched).
2. Each layer's policies are put on a chain: ordered by the extra FLOPs they spend
   (``slimformer.plan.flops``), keeping only those that keep fewer bytes than every
   cheaper one (at seq 512 BERT's chain is none → mlp → qkv+mlp → full: ``qkv``
   recomputes more than ``mlp`` and keeps more).
3. The ladder: from every layer at its chain's first policy, one layer moves one step up
   its chain at a time: level by level, the first layers first (their activations stay
   alive longest in backward, so they lower the most moments of the step). Each rung
   costs at least the compute of the one before; a rung whose predicted peak is not
   below every earlier rung's is dropped.
4. The plan is the first rung whose predicted peak fits the budget. A smaller budget can
   only pick a later rung: a lower or equal peak, more or equal recompute.

The budget covers every byte alive at the worst moment of a step (parameters, buffers,
optimizer state, the batch, gradients, activations, transients). For an unpadded model
the token count is the example's real tokens per row times the batch: a batch with
more real tokens per row needs more.
"""

import contextlib
import dataclasses
import io
import re
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from slimformer.layers.policies import POLICIES, check_policy
from slimformer.memory.measure import format_bytes
from slimformer.plan.flops import LayerFlops, layer_flops, step_flops_per_token
from slimformer.plan.optimizer import OptimizerCost, check_optimizer
from slimformer.plan.profile import FORWARD, MemoryProfile, Prediction, measure_profile

__all__ = [
    "Plan",
    "ladder",
    "max_batch",
    "max_seq",
    "parse_budget",
    "plan",
    "plannable_layers",
    "profile",
    "synthetic_batch",
]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_budget(budget: int | float | str) -> int:
    """Bytes from a number of bytes or a string such as "10GiB", "16 GB", "512MiB"."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(f"budget must be a number of bytes or a string such as '10GiB', got {budget!r}")
    if isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"budget must look like '10GiB', '16 GB' or '512MiB', got {budget!r}")
        budget = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not budget > 0:
        raise ValueError(f"budget must be positive, got {budget!r}")
    return int(budget)


def plannable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules of ``model`` that take a recompute policy, in module order."""
    found = []
    for name, module in model.named_modules():
        if getattr(module, "recompute", None) in POLICIES and not any(name.startswith(f"{n}.") for n, _ in found):
            found.append((name, module))
    return found


@contextlib.contextmanager
def _patched(model: nn.Module, unpad: bool) -> Iterator[list[tuple[str, nn.Module]]]:
    """The model's plannable layers; a model without any is patched for the block and
    unpatched after. Raises ValueError naming the encoder-like modules it does not know."""
    from slimformer.patch import patch, patch_summary, unpatch

    layers = plannable_layers(model)
    if layers:
        if unpad:
            raise ValueError("unpad=True applies to a model plan patches itself; this one is patched already")
        yield layers
        return
    summary = patch_summary(model)
    if summary.patched:
        raise ValueError(f"{type(model).__name__} is patched but has no layer with a recompute policy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nothing to patch": the error below says more
        patch(model, unpad=unpad)
    if not patch_summary(model).patched:
        raise ValueError(_unknown_model_message(model))
    try:
        layers = plannable_layers(model)
        if not layers:
            raise ValueError(_unknown_model_message(model))
        yield layers
    finally:
        unpatch(model)


def _unknown_model_message(model: nn.Module) -> str:
    from slimformer.patch import patch_summary

    left = [f"{row[0]} ({row[1]}: {row[2]})" for row in patch_summary(model).rows() if "->" not in row[2]]
    kinds = sorted({type(m).__name__ for m in model.modules() if re.search(r"Layer|Block", type(m).__name__)})
    known = "BERT-family encoders (BERT, RoBERTa, DistilBERT, ALBERT, MPNet, ModernBERT ...) and torch/slimformer TransformerEncoderLayers"
    detail = "; ".join(left[:6]) or f"its layer classes: {', '.join(kinds) or 'none found'}"
    return (
        f"cannot plan {type(model).__name__}: it has no layer slimformer can patch with a recompute policy "
        f"(plan knows {known}); {detail}"
    )


def _default_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The model's ``loss`` output; without one (no labels), the mean of its first output."""
    out = model(**batch)
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is not None:
        return loss
    first = out if isinstance(out, torch.Tensor) else out[0]
    return first.float().mean()


@dataclasses.dataclass
class _Batch:
    """Batches of any number of rows (and any shorter seq) cut from an example batch."""

    example: dict
    rows: int
    seq: int
    device: torch.device
    unpadded: bool

    @classmethod
    def of(cls, model: nn.Module, example: dict, device: torch.device, unpadded: bool) -> "_Batch":
        if not isinstance(example, dict) or not example:
            raise TypeError(f"example_batch must be a non-empty dict of the model's keyword inputs, got {example!r}")
        tensors = {k: v for k, v in example.items() if isinstance(v, torch.Tensor)}
        if not tensors:
            raise ValueError("example_batch holds no tensor")
        rows = next(iter(tensors.values())).shape[0] if next(iter(tensors.values())).dim() else 0
        for key, value in tensors.items():
            if value.dim() == 0 or value.shape[0] != rows:
                raise ValueError(
                    f"example_batch[{key!r}] must have the batch ({rows} rows) as its first dim, got shape "
                    f"{tuple(value.shape)}"
                )
        _check_accepted(model, example)
        seqs = _sequence_tensors(example)
        seq = max(v.shape[1] for v in seqs) if seqs else 1
        return cls(
            {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in example.items()},
            rows,
            seq,
            device,
            unpadded,
        )

    def make(self, rows: int, seq: int | None = None) -> dict:
        index = torch.arange(rows, device=self.device) % self.rows
        out = {}
        for key, value in self.example.items():
            if isinstance(value, torch.Tensor):
                value = value[index]
                if seq is not None and value.dim() >= 2 and value.shape[1] == self.seq:
                    value = value[:, :seq]
            out[key] = value
        return out

    def tokens(self, batch: dict) -> float:
        return self.size(batch)[0]

    def size(self, batch: dict) -> tuple[float, float]:
        """(tokens, pairs): the batch's tokens (real ones when unpadded) and Σ over rows of
        the row's tokens² (its attention's query-key pairs)."""
        mask = batch.get("attention_mask")
        if self.unpadded and isinstance(mask, torch.Tensor) and mask.dim() == 2:
            real = mask.sum(dim=1, dtype=torch.float64)
            return float(real.sum()), float(real.square().sum())
        ids = _sequence_tensors(batch)[0]
        return float(ids.shape[0] * ids.shape[1]), float(ids.shape[0] * ids.shape[1] ** 2)

    def row_bytes(self) -> int:
        return sum(v[:1].numel() * v.element_size() for v in self.example.values() if isinstance(v, torch.Tensor))


def _check_accepted(model: nn.Module, example: dict) -> None:
    import inspect

    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    # a forward taking **kwargs (transformers') would swallow a misspelt tensor: tensors must be named
    unknown = sorted(k for k, v in example.items() if k not in parameters and isinstance(v, torch.Tensor))
    if unknown:
        raise ValueError(
            f"example_batch has keys {type(model).__name__}.forward does not take: {unknown} "
            f"(it takes {list(parameters)})"
        )


def _unpadded(model: nn.Module) -> bool:
    return any(getattr(m, "unpad", False) is True for m in model.modules())


def profile(
    model: nn.Module,
    example_batch: dict,
    *,
    optimizer: str = "adamw",
    autocast: torch.dtype | None = None,
    loss_fn: Callable[[nn.Module, dict], torch.Tensor] | None = None,
    unpad: bool = False,
    rows: Sequence[int] = (1, 2, 4),
    seqs: Sequence[int] | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> tuple[MemoryProfile, list[LayerFlops]]:
    """Measure ``model``'s step memory at ``rows`` rows of ``example_batch`` (its rows
    repeated in order), leaving the model as it was (its policies, gradients, mode, random
    state; patched for the measurement if it was not). With ``seqs``, at ``rows`` rows of
    the longest of them and at the first two of ``rows`` of each shorter one (the example
    cut to it) where one of those holds as many tokens as a batch of the longest: 1 row
    of s beside 2 rows of s/2 tell what grows with each row's tokens²
    (``slimformer.plan.profile``). Returns the profile and each forward stage's layer
    FLOPs (see ``slimformer.plan.flops``)."""
    check_optimizer(optimizer)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters to train")
    device = params[0].device
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError(f"{type(model).__name__} has no trainable parameter")
    dtype = trainable[0].dtype
    cost = OptimizerCost.measure(optimizer, dtype, device)
    saved_grads = [p.grad for p in params]
    training = [m.training for m in model.modules()]
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), _patched(model, unpad) as layers:
            saved_policies = [module.recompute for _, module in layers]
            unpadded = _unpadded(model)
            batches = _Batch.of(model, example_batch, device, unpadded)
            loss = loss_fn or _default_loss
            model.train()
            try:
                seq = batches.seq if seqs is None else max(seqs)
                points = [(n, seq) for n in rows]
                longest = {batches.tokens(batches.make(*point)) for point in points}
                for short in sorted(set(seqs or ())):
                    more = [(n, short) for n in rows[:2]]
                    if short < seq and any(batches.tokens(batches.make(*point)) in longest for point in more):
                        points += more  # else (unpadded rows of other lengths) no run pairs with one above
                full_tokens = batches.tokens(batches.example) / batches.rows
                profile_ = measure_profile(
                    model,
                    layers,
                    lambda point: batches.make(*point),
                    batches.size,
                    loss,
                    optimizer=cost,
                    autocast=autocast,
                    policies=POLICIES,
                    points=points,
                    row_bytes=batches.row_bytes(),
                    row_tokens=full_tokens * (seq / batches.seq),
                    seq=seq,
                    unpadded=unpadded,
                    progress=progress,
                )
                flops = [layer_flops(layers[i][1], seq) for i in profile_.stage_layer if i is not None]
                profile_.step_flops = step_flops_per_token(model, [m for _, m in layers], flops)
            finally:
                for (_, module), policy in zip(layers, saved_policies):
                    module.recompute = policy
    finally:
        for module, mode in zip(model.modules(), training):
            module.training = mode
        for p, grad in zip(params, saved_grads):
            p.grad = grad
    return profile_, flops


@dataclasses.dataclass
class Rung:
    """One plan of the ladder: policies per layer, its prediction and extra FLOPs per token."""

    policies: tuple[str, ...]
    prediction: Prediction
    extra_flops: float


def ladder(profile_: MemoryProfile, flops: list[LayerFlops], batch: int, seq: int | None = None) -> list[Rung]:
    """The ladder of step 3 in the module docstring, rungs with a lower peak only."""
    seq = seq or profile_.seq
    tokens, pairs = profile_.tokens(batch, seq), profile_.pairs(batch, seq)
    n = len(profile_.layers)
    stage_flops = dict(zip([i for i, layer in enumerate(profile_.stage_layer) if layer is not None], flops))
    chains = []
    for layer in range(n):
        stages = [i for i, owner in enumerate(profile_.stage_layer) if owner == layer]
        kept = {p: sum(profile_.costs[(FORWARD, i, p)].delta(tokens, pairs) for i in stages) for p in profile_.policies}
        extra = {p: sum(stage_flops[i].extra(p) for i in stages) for p in profile_.policies}
        chain = []
        for policy in sorted(profile_.policies, key=lambda p: (extra[p], kept[p])):
            if not chain or kept[policy] < kept[chain[-1]]:
                chain.append(policy)
        chains.append((chain, extra))
    levels = [0] * n
    rungs: list[Rung] = []

    def add() -> None:
        policies = tuple(chains[i][0][levels[i]] for i in range(n))
        prediction = profile_.predict(policies, batch, seq)
        extra = sum(chains[i][1][policies[i]] for i in range(n))
        if not rungs or prediction.peak_bytes < rungs[-1].prediction.peak_bytes:
            rungs.append(Rung(policies, prediction, extra))

    add()
    for level in range(1, max(len(chain) for chain, _ in chains)):
        for layer in range(n):
            if level < len(chains[layer][0]):
                levels[layer] = level
                add()
    return rungs


@dataclasses.dataclass
class Plan:
    """A training plan: ``policies`` (layer name -> recompute policy), ``peak_bytes``
    (predicted step peak) and ``prediction`` (its breakdown), ``budget``, ``batch`` and
    ``seq``, ``optimizer``, ``extra_compute`` (the recompute's extra FLOPs as a fraction
    of the step's), ``profile`` (the measurements, to predict other batches or policies)
    and ``rungs`` (every plan of the ladder). ``apply(model)`` sets it; ``print(plan)``
    shows a table."""

    policies: dict[str, str]
    prediction: Prediction
    budget: int
    batch: int
    seq: int
    optimizer: str
    extra_compute: float
    profile: MemoryProfile
    rungs: list[Rung]
    unpad: bool
    autocast: torch.dtype | None

    @property
    def peak_bytes(self) -> int:
        return self.prediction.peak_bytes

    def apply(self, model: nn.Module) -> nn.Module:
        """Patch ``model`` (if it is not, with the plan's ``unpad``) and set each layer's
        policy; returns it. ValueError if its layers are not the planned ones (nothing set)."""
        from slimformer.patch import patch

        layers = dict(plannable_layers(model))
        patched_here = False
        if not layers:
            patch(model, unpad=self.unpad)
            layers, patched_here = dict(plannable_layers(model)), True
        if list(layers) != list(self.policies):
            if patched_here:
                from slimformer.patch import unpatch

                unpatch(model)
            raise ValueError(
                f"the model's layers {list(layers)[:3]}... are not the planned ones {list(self.policies)[:3]}..."
            )
        for name, policy in self.policies.items():
            layers[name].recompute = check_policy(policy)
        return model

    def table(self) -> Table:
        tokens = "real tokens" if self.profile.unpadded else "tokens"
        autocast = f", {str(self.autocast).removeprefix('torch.')} autocast" if self.autocast else ""
        table = Table(
            title=f"sf.plan: batch {self.batch} × seq {self.seq} ({self.profile.tokens(self.batch, self.seq):,.0f} "
            f"{tokens}), {self.optimizer}{autocast}, budget {format_bytes(self.budget)}, {self.profile.device}"
        )
        table.add_column("step peak, at the worst moment")
        table.add_column("bytes / layers", justify="right")
        for policy in dict.fromkeys(self.policies.values()):
            names = [n for n, p in self.policies.items() if p == policy]
            table.add_row(f"recompute {policy!r}", f"layers {_ranges(self.profile.layers, names)}")
        table.add_section()
        for name, size in self.prediction.breakdown.items():
            table.add_row(name, format_bytes(size))
        table.add_section()
        fits = "fits" if self.peak_bytes <= self.budget else "DOES NOT FIT"
        table.add_row(f"predicted step peak ({fits}), at the {self.prediction.moment}", format_bytes(self.peak_bytes))
        table.add_row("largest transient in backward", format_bytes(self.prediction.largest_backward_transient))
        table.add_row("extra compute of the recompute (est.)", f"{100 * self.extra_compute:.1f}% of the step's FLOPs")
        return table

    def __rich__(self) -> Table:
        return self.table()

    def __str__(self) -> str:
        console = Console(file=io.StringIO(), width=110, color_system=None, record=True)
        console.print(self.table())
        return console.export_text()


def _ranges(all_names: list[str], names: list[str]) -> str:
    """Layer indices as ranges: "0-3, 7"."""
    index = sorted(all_names.index(n) for n in names)
    parts, start = [], index[0]
    for a, b in zip(index, index[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)


def choose(
    profile_: MemoryProfile,
    flops: list[LayerFlops],
    budget: int,
    batch: int,
    seq: int | None = None,
    *,
    unpad: bool = False,
    autocast: torch.dtype | None = None,
) -> Plan:
    """The first rung of the ladder whose predicted peak fits ``budget`` at ``batch`` rows
    of ``seq`` positions, as a ``Plan``; ValueError (what the least peak is made of) if none."""
    seq = seq or profile_.seq
    optimizer = profile_.optimizer.name
    rungs = ladder(profile_, flops, batch, seq)
    fitting = [rung for rung in rungs if rung.prediction.peak_bytes <= budget]
    if not fitting:
        raise ValueError(_too_small(budget, rungs[-1].prediction, batch, seq, optimizer))
    rung = fitting[0]
    extra = rung.extra_flops / profile_.step_flops  # both per token
    return Plan(
        dict(zip(profile_.layers, rung.policies)),
        rung.prediction,
        budget,
        batch,
        seq,
        optimizer,
        extra,
        profile_,
        rungs,
        unpad,
        autocast,
    )


def _too_small(budget: int, least: Prediction, batch: int, seq: int, optimizer: str) -> str:
    parts = ", ".join(f"{name} {format_bytes(size)}" for name, size in least.breakdown.items() if size)
    hint = (
        "" if optimizer == "adamw-in-backward" else " (optimizer='adamw-in-backward' frees each gradient in backward)"
    )
    return (
        f"budget {format_bytes(budget)} is below the smallest step peak slimformer can plan at batch {batch} × seq "
        f"{seq} with {optimizer}: {format_bytes(least.peak_bytes)}, at the {least.moment}: {parts}{hint}"
    )


def plan(
    model: nn.Module,
    example_batch: dict,
    budget: int | float | str,
    optimizer: str = "adamw",
    *,
    device: torch.device | str | None = None,
    autocast: torch.dtype | None = None,
    loss_fn: Callable[[nn.Module, dict], torch.Tensor] | None = None,
    unpad: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> Plan:
    """The per-layer recompute policies that fit one training step of ``model`` on
    ``example_batch`` (a dict of its keyword inputs, labels included; every row of the
    batch is trained on) in ``budget`` ("10GiB", "16 GB" or bytes), at the least extra
    compute (see the module docstring).

    ``optimizer``: "adamw", "adamw-fused" or "adamw-in-backward" (``slimformer.plan.optimizer``).
    ``device``: where the model is (it is measured there; a different device raises).
    ``autocast``: the dtype of ``torch.autocast`` the step runs under (bf16, say), or None.
    ``loss_fn(model, batch)``: the loss; by default the output's ``loss``, or without
    labels the mean of the first output. ``unpad``: for a model not patched yet, patch it
    with ``unpad=True`` (then tokens are real tokens). The model is left as it was.

    Raises ValueError for a budget below the smallest possible peak (saying what that is
    and what it is made of), an unknown optimizer, a model without a layer slimformer can
    plan, a batch the model does not take; TypeError for arguments of the wrong type.
    """
    budget = parse_budget(budget)
    check_optimizer(optimizer)
    _check_device(model, device)
    profile_, flops = profile(
        model, example_batch, optimizer=optimizer, autocast=autocast, loss_fn=loss_fn, unpad=unpad, progress=progress
    )
    rows = next(v for v in example_batch.values() if isinstance(v, torch.Tensor)).shape[0]
    return choose(profile_, flops, budget, rows, unpad=unpad, autocast=autocast)


def _check_device(model: nn.Module, device) -> None:
    if device is None:
        return
    device = torch.device(device)
    actual = next(model.parameters()).device
    if actual.type != device.type or (device.index is not None and actual.index != device.index):
        raise ValueError(f"device is {device} but the model is on {actual}: move it there first (plan measures it)")


def synthetic_batch(model: nn.Module, rows: int, seq: int, device: torch.device | None = None) -> dict:
    """Random inputs for a HF model by its class: token ids, an all-ones mask, and labels
    as its head takes them (masked LM: 15% of the tokens; sequence classification and
    question answering: per row; token classification: per token)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "vocab_size"):
        raise ValueError(f"{type(model).__name__} is not a HF model with a vocab_size: pass example_batch")
    device = device or next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(config.vocab_size, (rows, seq), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    name = type(model).__name__
    if "MaskedLM" in name:
        labels = ids.clone()
        labels[torch.rand(rows, seq, generator=generator) > 0.15] = -100
        batch["labels"] = labels
    elif "SequenceClassification" in name:
        batch["labels"] = torch.zeros(rows, dtype=torch.long)
    elif "TokenClassification" in name:
        batch["labels"] = torch.zeros(rows, seq, dtype=torch.long)
    elif "QuestionAnswering" in name:
        batch["start_positions"] = batch["end_positions"] = torch.zeros(rows, dtype=torch.long)
    return {k: v.to(device) for k, v in batch.items()}


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n), for fits monotone (True then False); low - 1 if none."""
    if not fits(low):
        return low - 1
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def max_batch(
    model: nn.Module,
    seq_len: int,
    budget: int | float | str,
    optimizer: str = "adamw",
    *,
    example_batch: dict | None = None,
    limit: int = 1 << 16,
    **kwargs,
) -> tuple[int, Plan]:
    """The largest batch of ``seq_len`` tokens per row whose step fits ``budget``, and its
    plan (the least recompute that fits it). ``example_batch`` (its rows are repeated;
    cut to ``seq_len``) or, for a HF model, random inputs by its head (``synthetic_batch``).
    Other keywords as ``plan``. ValueError if not even one row fits."""
    budget = parse_budget(budget)
    check_optimizer(optimizer)
    example = example_batch if example_batch is not None else synthetic_batch(model, 2, seq_len)
    example = _cut(example, seq_len)
    profile_, flops = profile(model, example, optimizer=optimizer, **kwargs)

    best = largest_batch(profile_, flops, budget, limit)
    return best, choose(
        profile_, flops, budget, best, unpad=kwargs.get("unpad", False), autocast=kwargs.get("autocast")
    )


def largest_batch(profile_: MemoryProfile, flops: list[LayerFlops], budget: int, limit: int = 1 << 16) -> int:
    """The most rows at the profile's seq whose least-memory plan fits ``budget``;
    ValueError (what one row's least peak is made of) if not even one row fits."""
    best = _largest(lambda b: ladder(profile_, flops, b)[-1].prediction.peak_bytes <= budget, 1, limit)
    if best < 1:
        least = ladder(profile_, flops, 1)[-1].prediction
        raise ValueError(_too_small(budget, least, 1, profile_.seq, profile_.optimizer.name))
    return best


def _cut(example: dict, seq: int) -> dict:
    """``example`` with its (batch, seq, ...) tensors cut to ``seq``; ValueError if shorter."""
    out = {}
    for key, value in example.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            if value.shape[1] < seq:
                raise ValueError(f"example_batch[{key!r}] has {value.shape[1]} positions, fewer than seq_len={seq}")
            value = value[:, :seq]
        out[key] = value
    return out


def max_seq(
    model: nn.Module,
    batch: int,
    budget: int | float | str,
    optimizer: str = "adamw",
    *,
    example_batch: dict | None = None,
    longest: int | None = None,
    **kwargs,
) -> tuple[int, Plan]:
    """The longest sequence (up to ``longest``: the example's, or the model's
    ``max_position_embeddings``) at which ``batch`` rows fit ``budget``, and its plan.
    Measured at 1, 2 and 4 rows of ``longest`` positions (even: one less for an odd one)
    and 1 and 2 rows of half of them, predicted in tokens and in each row's tokens²."""
    budget = parse_budget(budget)
    check_optimizer(optimizer)
    if example_batch is None:
        longest = longest or getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if longest is None:
            raise ValueError("pass example_batch or longest= for a model without config.max_position_embeddings")
        example_batch = synthetic_batch(model, 1, longest)
    seq = _example_seq(example_batch)
    seqs = (seq // 2, 2 * (seq // 2)) if seq >= 2 else (seq,)
    profile_, flops = profile(model, example_batch, optimizer=optimizer, seqs=seqs, **kwargs)
    top = seq if longest is None else min(longest, seq)
    best = _largest(lambda s: ladder(profile_, flops, batch, s)[-1].prediction.peak_bytes <= budget, 1, top)
    if best < 1:
        raise ValueError(_too_small(budget, ladder(profile_, flops, batch, 1)[-1].prediction, batch, 1, optimizer))
    return best, choose(
        profile_, flops, budget, batch, best, unpad=kwargs.get("unpad", False), autocast=kwargs.get("autocast")
    )


def _sequence_tensors(example: dict) -> list[torch.Tensor]:
    """The (batch, seq, ...) inputs of ``example``, labels left out."""
    return [v for k, v in example.items() if isinstance(v, torch.Tensor) and v.dim() >= 2 and k != "labels"]


def _example_seq(example: dict) -> int:
    seqs = _sequence_tensors(example)
    if not seqs:
        raise ValueError("example_batch has no (batch, seq) tensor")
    return max(v.shape[1] for v in seqs)
