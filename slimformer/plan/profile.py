"""A model's training-step memory, measured at small batches and predicted at any batch.

One training step is a sequence of **stages**: the forward of what runs before the first
planned layer ("embeddings"), of each application of a planned layer (a module with a
``recompute`` policy: a fused encoder layer; ALBERT's shared layer once per
application), of what runs after the last ("head": pooler, heads, loss); then their
backwards in reverse; then the optimizer step. Hooks split the step at those
boundaries, and ``slimformer.memory.peak_memory`` reads, for each stage, what it leaves
allocated (``delta``) and the most it allocates above its start (``excess``):

* forward: a pre- and a post-hook on each planned layer;
* backward: a hook on each planned layer's output (its gradient is ready: the layer's
  backward starts) and on its input (its gradient is ready: the layer's backward ends);
* the gradients: a post-accumulate-grad hook on each trainable parameter records the
  stage in whose backward its gradient appears, and its bytes.

What slimformer's layers keep grows with the number of tokens (nothing they keep grows
with seq²), and what they make inside an op is affine in tokens too, up to a cap: the CPU
references work in blocks of about 2**20 elements and ``linear_cross_entropy`` in chunks
of at most 16 MiB of logits, so such a temporary grows with the batch, then stays. The
profile measures at three sizes (1, 2 and 4 rows of the example) and fits each moment
as the chords between them (``Envelope``), the last one carried on: exact where the
caps are reached by the second size, above the allocator (never below) where they are
reached later. The batches cycle through the example's rows, so what follows each
row's labels or real tokens rather than the row count extrapolates as the example's
mix where the 2- and 4-row batches hold that mix (an example of 2 rows). Along the sequence (``sf.max_seq``) a row's attention scores in the CPU reference
grow with its tokens² while they fit one block: a run of 2 rows of half the sequence
beside 1 row of all of it gives that term (``Affine.per_pair``). A stage's numbers
depend on its own layer's policy only, so any per-layer mix is predicted by
walking the stages with each one's policy (``MemoryProfile.predict``): the live bytes
start at what persists (parameters, buffers, optimizer state, the batch), each stage
adds its delta, and the peak is the largest ``live + excess`` met on the way, the
optimizer step's temporaries included.

The optimizer is never run on the model: its state and temporaries come from
``OptimizerCost``, measured on stand-in tensors. For ``adamw-in-backward`` the
measured backward frees each gradient in its hook, as the real one does, and adds the
per-parameter step's temporaries at that moment.
"""

import bisect
import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from slimformer.memory.peak import peak_memory
from slimformer.plan.optimizer import OptimizerCost

__all__ = ["Affine", "Envelope", "MemoryProfile", "Prediction", "StageCost", "measure_profile"]

FORWARD, BACKWARD, RELEASE = "forward", "backward", "autocast exit"
EMBEDDINGS, HEAD = "embeddings", "head"


@dataclasses.dataclass(frozen=True)
class Affine:
    """``intercept + slope * tokens + per_pair * pairs`` (bytes). ``pairs`` counts the
    (query, key) positions of a batch's rows, Σ over rows of their tokens²: what a CPU
    attention reference's blocks of scores grow with while a row's scores fit one block."""

    intercept: float
    slope: float
    per_pair: float = 0.0

    def __call__(self, tokens: float, pairs: float = 0.0) -> float:
        return self.intercept + self.slope * tokens + self.per_pair * pairs


@dataclasses.dataclass(frozen=True)
class Envelope:
    """The most of several moments (one per op of a stage), each a piecewise line in
    tokens: ``pieces[i]`` holds the moments' lines for token counts up to ``knots[i]`` (the
    last piece beyond the last knot), each piece the chords between two measured sizes.
    A stage's peak is the largest moment, and which one is largest can change with the
    token count (a weight-sized temporary at small batches, an activation at large). A
    moment need not be one line: a temporary capped by its op (``linear_cross_entropy``'s
    chunk of logits, an attention reference's block of scores) grows, then stays; the
    pieces follow it, and beyond the last measured size the last chord goes on. One
    moment's envelope is a piecewise line (a stage's delta, its frees)."""

    pieces: tuple[tuple[Affine, ...], ...]
    knots: tuple[float, ...] = ()

    def __call__(self, tokens: float, pairs: float = 0.0) -> float:
        lines = self.pieces[bisect.bisect_left(self.knots, tokens)]
        return max(line(tokens, pairs) for line in lines)

    @classmethod
    def fit(cls, runs: Sequence[tuple[float | tuple[float, float], Sequence[float]]]) -> "Envelope":
        """From (tokens or (tokens, pairs), [bytes at each moment]) per run, at least two
        token counts. A piece pairs its two sizes' moments one by one (the same ops) when
        their runs have as many, else it follows each run's largest (a loop whose length
        follows the batch makes moments that do not pair). With two runs of equal tokens in
        rows of different lengths, a moment's bytes are ``f(tokens) + per_pair * pairs``,
        ``per_pair`` from those two, every run's moments paired (or their largest), and ``f``
        the chords through the rest. Lines below another one at every size are dropped."""
        points = [(float(x), 0.0) if isinstance(x, (int, float)) else (float(x[0]), float(x[1])) for x, _ in runs]
        values = [[float(v) for v in moments] for _, moments in runs]
        tokens = sorted({t for t, _ in points})
        if len(tokens) < 2:
            raise ValueError(f"a line needs two token counts, got {tokens}")
        couples = [
            (i, j) for i in range(len(points)) for j in range(i + 1, len(points))
            if points[i][0] == points[j][0] and points[i][1] != points[j][1]
        ]  # fmt: skip
        everyone = _paired(values) if couples else None
        pieces = []
        for a, b in zip(tokens, tokens[1:]):
            if everyone is None:
                mine = [i for i, (t, _) in enumerate(points) if t in (a, b)]
                columns, per_pairs = _paired([values[i] for i in mine]), None
                chosen = [points[i] for i in mine]
            else:
                columns, chosen = everyone, points
                per_pairs = [
                    sum((ys[i] - ys[j]) / (points[i][1] - points[j][1]) for i, j in couples) / len(couples)
                    for ys in columns
                ]
            lines = []
            for k, ys in enumerate(columns):
                per_pair = 0.0 if per_pairs is None else per_pairs[k]
                at = {t: [y - per_pair * p for (u, p), y in zip(chosen, ys) if u == t] for t in (a, b)}
                low, high = (sum(at[t]) / len(at[t]) for t in (a, b))
                slope = (high - low) / (b - a)
                lines.append(Affine(low - slope * a, slope, per_pair))
            pieces.append(_upper(lines))
        return cls(tuple(pieces), tuple(tokens[1:-1]))


def _paired(values: list[list[float]]) -> list[list[float]]:
    """Per moment, its bytes in each run, when every run has as many moments; else one
    moment: each run's largest."""
    if len({len(v) for v in values}) == 1 and values[0]:
        return [list(column) for column in zip(*values)]
    return [[max(v, default=0.0) for v in values]]


def _upper(lines: list[Affine]) -> tuple[Affine, ...]:
    """``lines`` less those below another one at every tokens >= 0 and pairs >= 0."""
    if all(line.per_pair == 0 for line in lines):
        hull: list[Affine] = []  # the upper envelope over tokens >= 0, by slope ascending
        for line in sorted(set(lines), key=lambda line: (line.slope, -line.intercept)):
            if hull and hull[-1].slope == line.slope:
                continue  # same slope, lower or equal intercept
            while hull and hull[-1].intercept <= line.intercept:
                hull.pop()  # steeper and not lower at 0 tokens: above everywhere
            while len(hull) >= 2 and _meets(hull[-2], line) <= _meets(hull[-2], hull[-1]):
                hull.pop()  # overtaken by the new line before it overtook its predecessor
            hull.append(line)
        return tuple(hull)
    kept: list[Affine] = []  # with a pairs term: those no other line is above in every coefficient
    for line in sorted(set(lines), key=lambda line: (-line.intercept, -line.slope, -line.per_pair)):
        if not any(k.slope >= line.slope and k.per_pair >= line.per_pair for k in kept):
            kept.append(line)
    return tuple(kept)


def _meets(a: Affine, b: Affine) -> float:
    """Tokens where ``b`` (steeper) overtakes ``a``."""
    return (a.intercept - b.intercept) / (b.slope - a.slope)


_NOTHING = Envelope(((Affine(0, 0),),))


@dataclasses.dataclass(frozen=True)
class StageCost:
    """One stage under one policy: bytes it leaves allocated, its peak above its start, and
    (forward) what of those bytes a later point of the forward frees: ``frees`` pairs
    (the forward stage where they are freed, or the number of stages for the end of the
    forward's autocast region, bytes). Such bytes are kept or not by whoever reads them
    next (a layer at ``qkv`` keeps its fp32 input under autocast, where the others keep a
    bf16 copy and HF drops the input at the end of the model's forward), so they are
    credited to the stage that made them, not to the stage where they happen to be freed;
    autocast's cache of cast weights is freed at the end of its region, likewise credited."""

    delta: Envelope
    excess: Envelope
    frees: tuple[tuple[int, Envelope], ...] = ()


@dataclasses.dataclass
class Prediction:
    """A predicted training step: ``peak_bytes`` and what is alive at that moment
    (``breakdown``: name -> bytes, summing to the peak), where it happens (``moment``:
    "forward of layer 3", "optimizer step", ...) and the step's largest transient in
    backward above what was alive."""

    peak_bytes: int
    moment: str
    breakdown: dict[str, int]
    largest_backward_transient: int


@dataclasses.dataclass
class MemoryProfile:
    """A model's measured step memory (see the module docstring).

    ``layers``: the planned modules' names; ``stages``: the forward's stages in order,
    ``stage_layer[i]`` the index in ``layers`` of stage i's module (None for embeddings
    and head); ``costs[(phase, stage index, policy)]``; ``grads[stage index]``: the
    gradient bytes that appear in the stage's backward; ``fixed_bytes``: parameters and
    buffers; ``row_bytes``: the batch's bytes per row; ``row_tokens``: tokens per row
    (the real ones for an unpadded model); ``trainable``: the trainable parameters'
    bytes, one entry per tensor.
    """

    layers: list[str]
    stages: list[str]
    stage_layer: list[int | None]
    costs: dict[tuple[str, int, str], StageCost]
    grads: list[int]
    fixed_bytes: int
    row_bytes: int
    row_tokens: float
    trainable: list[int]
    optimizer: OptimizerCost
    policies: tuple[str, ...]
    device: str
    seq: int
    unpadded: bool
    step_flops: float = 0.0  # a training step's FLOPs per token (slimformer.plan.flops)

    def tokens(self, batch: int, seq: int | None = None) -> float:
        """Tokens in ``batch`` rows of ``seq`` positions (the profile's seq by default)."""
        return self.row_tokens * batch * (seq or self.seq) / self.seq

    def pairs(self, batch: int, seq: int | None = None) -> float:
        """(query, key) pairs in ``batch`` rows of ``seq`` positions: rows × their tokens²."""
        return batch * (self.row_tokens * (seq or self.seq) / self.seq) ** 2

    def _policy(self, stage: int, policies: Sequence[str]) -> str:
        """The policy a stage runs under: its layer's; embeddings and head take their
        neighbouring layer's (what they were measured next to)."""
        layer = self.stage_layer[stage]
        if layer is None:
            neighbour = self.stage_layer[1] if stage == 0 else self.stage_layer[-2]
            layer = 0 if neighbour is None else neighbour
        return policies[layer]

    def predict(self, policies: Sequence[str], batch: int, seq: int | None = None) -> Prediction:
        """The step peak with ``policies[i]`` on ``layers[i]``, at ``batch`` rows of
        ``seq`` positions (the profile's seq by default)."""
        if len(policies) != len(self.layers):
            raise ValueError(f"policies must name one policy per layer ({len(self.layers)}), got {len(policies)}")
        unknown = set(policies) - set(self.policies)
        if unknown:
            raise ValueError(f"policies {sorted(unknown)} were not measured; measured: {self.policies}")
        size = (self.tokens(batch, seq), self.pairs(batch, seq))
        in_backward = self.optimizer.name == "adamw-in-backward"
        state = self.optimizer.state_bytes(self.trainable)
        base = {
            "parameters and buffers": self.fixed_bytes,
            "optimizer state": state,
            "batch": round(self.row_bytes * batch * (seq or self.seq) / self.seq),
        }
        live = float(sum(base.values()))
        kept = [0.0] * len(self.stages)  # activations each stage keeps, until its backward
        grads = 0.0
        best = Prediction(round(live), "start", {**base}, 0)
        largest_transient = 0.0
        n = len(self.stages)
        order = [(FORWARD, i) for i in range(n)] + [(BACKWARD, i) for i in reversed(range(n))]
        for phase, stage in order:
            if (phase, stage) == (BACKWARD, n - 1):  # the forward's autocast region has ended
                live = self._free_later(n, policies, size, live, kept)
            cost = self.costs[(phase, stage, self._policy(stage, policies))]
            excess = cost.excess(*size)
            if phase == BACKWARD:
                largest_transient = max(largest_transient, excess)
            if live + excess > best.peak_bytes:
                best = self._moment(phase, stage, policies, base, kept, grads, live, excess)
            delta = cost.delta(*size)
            live += delta
            if phase == FORWARD:
                kept[stage] = delta
                live = self._free_later(stage, policies, size, live, kept)
            else:
                kept[stage] = 0.0
                grads += 0 if in_backward else self.grads[stage]
        if not in_backward:
            temporaries = self.optimizer.temporaries(self.trainable)
            if live + temporaries > best.peak_bytes:
                best = self._moment("optimizer", None, policies, base, kept, grads, live, temporaries)
        best.largest_backward_transient = round(largest_transient)
        return best

    def _free_later(self, where: int, policies, size: tuple[float, float], live: float, kept: list[float]) -> float:
        """``live`` less what earlier stages made and ``where`` frees (see ``StageCost.frees``),
        at ``size`` (tokens, pairs)."""
        for stage in range(min(where, len(self.stages))):
            for at, freed in self.costs[(FORWARD, stage, self._policy(stage, policies))].frees:
                if at == where:
                    live, kept[stage] = live - freed(*size), kept[stage] - freed(*size)
        return live

    def _moment(self, phase, stage, policies, base, kept, grads, live, excess) -> Prediction:
        """The breakdown of ``live + excess`` bytes at a stage's peak."""
        breakdown = {**base, "gradients": round(grads)}
        for i, name in enumerate(self.stages):
            if kept[i]:
                label = name if self.stage_layer[i] is None else f"{name} ({policies[self.stage_layer[i]]})"
                breakdown[f"activations: {label}"] = round(kept[i])
        accounted = sum(breakdown.values())
        breakdown["gradients between stages, other leftovers"] = round(live) - accounted
        if phase == "optimizer":
            moment, label = "optimizer step", "optimizer-step temporaries"
        else:
            moment, label = f"{phase} of {self.stages[stage]}", f"transient in {phase} of {self.stages[stage]}"
        breakdown[label] = round(excess)
        return Prediction(round(live + excess), moment, breakdown, 0)


class _StepRecorder:
    """Splits one measured step into stages (see the module docstring): the hooks mark the
    allocator's record (``PeakMemory.mark``), and ``intervals`` reads it after the step."""

    def __init__(self, peak, layers: list[nn.Module], params: list[nn.Parameter], in_backward: OptimizerCost | None):
        self.peak = peak
        self.forward_stages: list[tuple[str, int]] = []  # (stage name, layer index), in order
        self.grads: dict[str, int] = {}
        self.seen: set[nn.Parameter] = set()
        self.label = (FORWARD, EMBEDDINGS)  # the stage running now
        self.in_backward = in_backward
        self.handles = []
        for index, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre_hook(index)))
            self.handles.append(layer.register_forward_hook(self._post_hook(index)))
        for param in params:
            self.handles.append(param.register_post_accumulate_grad_hook(self._grad_hook))

    def close(self, label: tuple[str, str]) -> None:
        """The stage running now ends here; ``label`` begins."""
        self.peak.mark(("stage", label))
        self.label = label

    def _pre_hook(self, index):
        def hook(module, args):
            applied = sum(1 for _, i in self.forward_stages if i == index)  # ALBERT applies one layer many times
            stage = f"layer {index}" if not applied else f"layer {index} (application {applied + 1})"
            self.forward_stages.append((stage, index))
            self.close((FORWARD, stage))
            hidden = _first_grad_tensor(args)
            if hidden is not None:  # its gradient is ready when this application's backward ends
                hidden.register_hook(lambda grad, before=stage: self.close((BACKWARD, f"before {before}")))

        return hook

    def _post_hook(self, index):
        def hook(module, args, output):
            stage = self.forward_stages[-1][0]
            self.close((FORWARD, f"after {stage}"))
            out = _first_grad_tensor(output)
            if out is not None:
                out.register_hook(lambda grad, at=stage: self.close((BACKWARD, at)))

        return hook

    def _grad_hook(self, param: nn.Parameter) -> None:
        if param not in self.seen:
            self.seen.add(param)
            stage = self.label[1]
            self.grads[stage] = self.grads.get(stage, 0) + param.grad.numel() * param.grad.element_size()
        if self.in_backward is not None:
            # the per-parameter step's temporaries, on top of what is allocated now (it is not run)
            size = param.numel() * param.element_size()
            self.peak.mark(("extra", self.in_backward.temporaries([size])))
            param.grad = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def intervals(self) -> tuple[list[tuple[str, str, int, int, int, list[int]]], dict[tuple[str, str], int]]:
        """From the marks, after the step: (phase, stage label, start, end, peak, the
        allocator's moments in between) per stage run, all above the step's start; and the
        bytes a forward stage allocated that a later forward stage (or the autocast exit)
        freed: (label of the maker, label of the freeing stage or ``RELEASE``) -> bytes."""
        intervals = []
        label, start, top, moments = (FORWARD, EMBEDDINGS), 0, 0, []
        made: dict[int, tuple[str, int]] = {}  # address -> (forward stage label, bytes), of live allocations
        freed_later: dict[tuple[str, str], int] = {}
        for mark in self.peak.marks:
            for address, size in mark.events:
                if size > 0:
                    if label[0] == FORWARD:
                        made[address] = (label[1], size)
                    continue
                maker = made.pop(address, None)
                if maker is not None and label[0] in (FORWARD, RELEASE) and label[1] != maker[0]:
                    where = RELEASE if label[0] == RELEASE else label[1]
                    freed_later[(maker[0], where)] = freed_later.get((maker[0], where), 0) + maker[1]
            moments += mark.moments
            top = max(top, mark.top)
            kind, value = mark.label
            if kind == "extra":  # a moment of its own: what is allocated now plus the optimizer's temporaries
                moments.append(mark.live + value)
                continue
            intervals.append((*label, start, mark.live, top, moments))
            label, start, top, moments = value, mark.live, mark.live, []
        return intervals, freed_later


def _first_grad_tensor(value):
    """The first tensor requiring grad in a module's args or output (tuples, lists, dicts, ModelOutputs)."""
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        found = _first_grad_tensor(item)
        if found is not None:
            return found
    return None


def _stage_intervals(recorder: _StepRecorder) -> tuple[list[str], list[int | None], dict, dict, dict]:
    """Merge the recorder's raw intervals into one (start, end, peak) per (phase, stage)."""
    intervals, freed_later = recorder.intervals()
    names = [EMBEDDINGS] + [stage for stage, _ in recorder.forward_stages] + [HEAD]
    layer_of = [None] + [index for _, index in recorder.forward_stages] + [None]
    position = {name: i for i, name in enumerate(names)}

    def stage_of(label: str) -> int:
        # "after X" belongs to the next stage's forward; "before X" to the previous stage's backward
        if label.startswith("after "):
            return position[label.removeprefix("after ")] + 1
        if label.startswith("before "):
            return position[label.removeprefix("before ")] - 1
        return position[label]

    merged: dict[tuple[str, int], list] = {}
    for phase, label, start, end, top, samples in intervals:
        if phase == RELEASE:
            continue  # its frees are credited to the stages that made them
        key = (phase, stage_of(label))
        if key in merged:
            entry = merged[key]
            entry[1], entry[2] = end, max(entry[2], top)
            entry[3] += samples
        else:
            merged[key] = [start, end, top, list(samples)]
    grads = {}
    for label, size in recorder.grads.items():
        index = stage_of(label)
        grads[index] = grads.get(index, 0) + size
    frees: dict[int, dict[int, int]] = {}  # maker stage -> {where: bytes}
    for (label, where), size in freed_later.items():
        maker = stage_of(label)
        at = len(names) if where == RELEASE else stage_of(where)
        if at != maker:
            frees.setdefault(maker, {})[at] = frees.get(maker, {}).get(at, 0) + size
            if at < len(names):
                merged[(FORWARD, at)][1] += size  # the freeing stage's delta, without the credited bytes
    return names, layer_of, merged, grads, frees


def _run_step(model, batch, loss_fn, layers, params, autocast, in_backward, device):
    """One forward and backward of ``model`` on ``batch``, split into stages."""
    for param in params:
        param.grad = None
    with peak_memory(device, moments=True) as peak:
        recorder = _StepRecorder(peak, layers, params, in_backward)
        try:
            context = torch.autocast(device.type, autocast) if autocast is not None else contextlib.nullcontext()
            with context:
                loss = loss_fn(model, batch)
                recorder.close((RELEASE, ""))
            recorder.close((BACKWARD, HEAD))
            loss.backward()
            del loss
            recorder.close((BACKWARD, "end"))
        finally:
            recorder.remove()
    for param in params:
        param.grad = None
    return _stage_intervals(recorder)


def _stage_cost(runs) -> StageCost:
    """Fit one stage's runs: ((tokens, pairs), delta, moments, {where: bytes freed later})."""
    wheres = sorted({at for *_, freed in runs for at in freed})
    return StageCost(
        Envelope.fit([(x, [d]) for x, d, _, _ in runs]),
        Envelope.fit([(x, m) for x, _, m, _ in runs]),
        tuple((at, Envelope.fit([(x, [freed.get(at, 0)]) for x, _, _, freed in runs])) for at in wheres),
    )


def measure_profile(
    model: nn.Module,
    layers: list[tuple[str, nn.Module]],
    make_batch: Callable[[object], dict],
    batch_size: Callable[[dict], tuple[float, float]],
    loss_fn: Callable[[nn.Module, dict], torch.Tensor],
    *,
    optimizer: OptimizerCost,
    autocast: torch.dtype | None,
    policies: Sequence[str],
    points: Sequence,
    row_bytes: int,
    row_tokens: float,
    seq: int,
    unpadded: bool,
    progress: Callable[[str], None] = lambda _: None,
) -> MemoryProfile:
    """Measure ``model``'s stages under each policy on ``make_batch(point)`` for each of
    ``points`` (at least two token counts; ``batch_size(batch)``: its (tokens, pairs)) and
    fit them (see the module docstring). ``layers`` (name, module) are set to each policy
    in turn; the caller restores them."""
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    modules = [module for _, module in layers]
    in_backward = optimizer if optimizer.name == "adamw-in-backward" else None
    samples: dict[tuple[str, int, str], list] = {}
    grads: dict[int, int] = {}
    shape = None
    for module in modules:
        module.recompute = policies[0]
    _run_step(model, make_batch(points[0]), loss_fn, modules, params, autocast, in_backward, device)  # warm-up
    for policy in policies:
        for module in modules:
            module.recompute = policy
        for point in points:
            progress(f"{policy}, {point}")
            batch = make_batch(point)
            size = batch_size(batch)
            names, layer_of, merged, step_grads, frees = _run_step(
                model, batch, loss_fn, modules, params, autocast, in_backward, device
            )
            if shape is None:
                shape, grads = (names, layer_of), step_grads
            elif (names, layer_of) != shape:
                raise RuntimeError(f"the model ran different layers at {policy!r}, {point}: {names} vs {shape[0]}")
            for (phase, stage), (start, end, top, moments) in merged.items():
                # the interval's own peak is a moment too: it holds what the per-op samples may miss
                moments = [m - start for m in moments] + [top - start]
                freed = frees.get(stage, {}) if phase == FORWARD else {}
                samples.setdefault((phase, stage, policy), []).append((size, end - start, moments, freed))
    costs = {key: _stage_cost(runs) for key, runs in samples.items()}
    names, layer_of = shape
    for phase in (FORWARD, BACKWARD):  # a stage that made no interval (no hook between two others) costs nothing
        for stage in range(len(names)):
            for policy in policies:
                costs.setdefault((phase, stage, policy), StageCost(_NOTHING, _NOTHING))
    fixed = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers())
    }
    return MemoryProfile(
        layers=[name for name, _ in layers],
        stages=names,
        stage_layer=layer_of,
        costs=costs,
        grads=[grads.get(i, 0) for i in range(len(names))],
        fixed_bytes=sum(fixed.values()),
        row_bytes=row_bytes,
        row_tokens=row_tokens,
        trainable=[p.numel() * p.element_size() for p in params],
        optimizer=optimizer,
        policies=tuple(policies),
        device=str(device),
        seq=seq,
        unpadded=unpadded,
    )
