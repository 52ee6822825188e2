"""What a row of the speed phase is, and how one is run.

A ``Case`` is one set of inputs (an attention shape with its flags, a norm's hidden size,
a GEMM's shape) measured in one or more modes (``fwd``, ``bwd``, ``fwd+bwd``,
``inference``) by several providers: slimformer's and the baselines', all in the same
process, on inputs of the same values. ``build()`` allocates the inputs only when the
case runs, so one case's tensors are alive at a time. Each (case, mode) makes a ``Row``
with every provider's ``Timing``, or the one-line reason it has none (a backend that does
not run this shape, a time limit).
"""

import gc
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from bench.gpu_check.timing import CaseTimeout, Clock, time_limit

MODES = ("fwd", "bwd", "fwd+bwd")
MEASURE_LIMIT_S = 90.0  # one provider in one mode, compile included


@dataclass
class Provider:
    """One implementation of a case: ``fn(*inputs)`` on each input copy.

    inputs: one tuple of tensors per copy (the rounds rotate over them); params: tensors
    the backward also differentiates (a module's weights); baseline: a reference the
    slimformer providers are compared with; compiles: built by torch.compile (so the
    precompile workers warm it too); modes: the modes it runs (None: all of the case's).
    """

    fn: Callable
    inputs: Sequence[tuple]
    params: tuple = ()
    baseline: bool = False
    compiles: bool = False
    modes: tuple[str, ...] | None = None

    def steps(self, mode: str) -> list[Callable[[], object]]:
        """The no-argument callables one round of ``mode`` times, one per input copy."""
        if mode == "inference":
            return [_no_grad(self.fn, x) for x in self.inputs]
        if mode == "fwd":
            return [lambda x=x: self.fn(*x) for x in self.inputs]
        steps = []
        for x in self.inputs:
            leaves = [t for t in (*x, *self.params) if t.requires_grad]
            out = self.fn(*x)
            dout = torch.randn_like(out)
            if mode == "bwd":
                steps.append(
                    lambda out=out, leaves=leaves, dout=dout: torch.autograd.grad(out, leaves, dout, retain_graph=True)
                )
            else:
                steps.append(lambda x=x, leaves=leaves, dout=dout: torch.autograd.grad(self.fn(*x), leaves, dout))
            del out
        return steps


def _no_grad(fn, x):
    def step():
        with torch.no_grad():
            return fn(*x)

    return step


@dataclass(frozen=True)
class Case:
    """A set of inputs measured in ``modes`` by the providers ``build()`` returns.

    key: unique and stable (the precompile workers and the JSON name cases by it); label:
    the row's name in the tables; unit: "TFLOP/s" or "GB/s"; work: per mode, the FLOPs or
    bytes one call does (the same for every provider: the metric is work / median time);
    params: shape and flags, for the JSON.
    """

    key: str
    family: str
    label: str
    modes: tuple[str, ...]
    unit: str
    work: dict
    build: Callable[[], dict[str, Provider]]
    params: dict = field(default_factory=dict)


@dataclass
class Row:
    """One case in one mode: every provider's timing (``Timing.to_json()``) or ``{"error": ...}``."""

    case: str
    family: str
    label: str
    mode: str
    unit: str
    work: float
    params: dict
    baselines: list[str]
    results: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def brief(error: BaseException) -> str:
    """The first line of an error, with its type: what a table cell can hold."""
    first = next((line for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {first}"[:300]


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_case(case: Case, clock: Clock, deadline: float) -> list[Row]:
    """Measure every provider of ``case`` in every mode, each under its own time limit, the
    whole ending by ``deadline`` (``time.monotonic()``); errors become cells, never raise."""
    rows = []
    try:
        with time_limit(min(MEASURE_LIMIT_S, deadline - time.monotonic())):
            providers = case.build()
    except Exception as error:
        free_memory(clock.device)
        return [_row(case, mode, [], {"all": {"error": f"inputs: {brief(error)}"}}) for mode in case.modes]
    baselines = [name for name, p in providers.items() if p.baseline]
    for mode in case.modes:
        results = {}
        for name, provider in providers.items():
            if provider.modes is not None and mode not in provider.modes:
                continue
            left = deadline - time.monotonic()
            if left <= 1.0:
                results[name] = {"error": "not run: the phase's time was used up"}
                continue
            try:
                with time_limit(min(MEASURE_LIMIT_S, left)):
                    steps = provider.steps(mode)
                    results[name] = clock.measure(steps).to_json()
            except Exception as error:
                results[name] = {"error": brief(error)}
                if not isinstance(error, CaseTimeout):
                    results[name]["traceback"] = traceback.format_exc().splitlines()[-8:]
            finally:
                steps = None
                clock.synchronize()
        rows.append(_row(case, mode, baselines, results))
    providers = None
    free_memory(clock.device)
    return rows


def _row(case: Case, mode: str, baselines: list[str], results: dict) -> Row:
    return Row(case.key, case.family, case.label, mode, case.unit, case.work[mode], case.params, baselines, results)


def warm(case: Case, sync: Callable[[], None]) -> list[dict]:
    """Run each compiled or slimformer provider of ``case`` once per mode (a precompile
    worker's job: the kernels land in the on-disk caches). Returns what each took."""
    done = []
    try:
        providers = case.build()
    except Exception as error:
        return [{"case": case.key, "error": f"inputs: {brief(error)}"}]
    for name, provider in providers.items():
        if not (provider.compiles or name.startswith("slimformer")):
            continue
        for mode in provider.modes or case.modes:
            start = time.perf_counter()
            try:
                provider.steps(mode)[0]()
                sync()
                done.append(
                    {"case": case.key, "provider": name, "mode": mode, "seconds": round(time.perf_counter() - start, 2)}
                )
            except Exception as error:
                done.append({"case": case.key, "provider": name, "mode": mode, "error": brief(error)})
    return done
