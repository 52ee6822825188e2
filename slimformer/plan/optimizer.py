"""The optimizer step as a memory knob: which AdamW, and what each costs in memory.

Three ways to run AdamW, named as ``sf.plan`` takes them (``OPTIMIZERS``):

* ``adamw``: ``torch.optim.AdamW(params)``, torch's default implementation (foreach on
  CUDA, which makes a temporary the size of the whole optimizer state's half at once;
  one tensor at a time on CPU);
* ``adamw-fused``: ``torch.optim.AdamW(params, fused=True)``, one kernel per tensor
  list, no temporaries of the parameters' size;
* ``adamw-in-backward``: ``optimizer_in_backward(model, torch.optim.AdamW)``, the step
  applied to each parameter as soon as backward has accumulated its gradient, which is
  then freed: the gradients of the whole model never exist at once.

``OptimizerCost`` measures what one of them keeps (its state) and makes (its step's
temporaries) on small stand-in tensors, per byte of parameter, so that the planner never
runs an optimizer on the model it plans.
"""

import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch import nn

from slimformer.memory.peak import peak_memory

__all__ = ["OPTIMIZERS", "InBackwardOptimizer", "OptimizerCost", "make_optimizer", "optimizer_in_backward"]

OPTIMIZERS = ("adamw", "adamw-fused", "adamw-in-backward")


def check_optimizer(name: str) -> str:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")
    return name


class InBackwardOptimizer:
    """Per-parameter optimizers stepped during backward (see ``optimizer_in_backward``).

    ``step()`` only marks the end of a training step (the update already happened in
    backward) and ``zero_grad()`` does nothing (no gradient is left): both exist so that a
    training loop written for a plain optimizer runs unchanged. ``optimizers`` maps each
    parameter to its own optimizer (its ``state`` is that parameter's state);
    ``remove()`` takes the hooks off.
    """

    def __init__(self, params: list[nn.Parameter], make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]):
        self.optimizers = {param: make([param]) for param in params}
        self._stepped: set[nn.Parameter] = set()
        self._handles = [param.register_post_accumulate_grad_hook(self._step_one) for param in params]

    def _step_one(self, param: nn.Parameter) -> None:
        if param in self._stepped:
            raise RuntimeError(
                "a second backward before step(): gradient accumulation is not possible with the optimizer "
                "step applied in backward (each backward already updated the parameters); call step() once "
                "after every backward, or use a plain optimizer to accumulate gradients"
            )
        self.optimizers[param].step()
        param.grad = None
        self._stepped.add(param)

    def step(self) -> None:
        self._stepped.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.optimizers:
            param.grad = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def optimizer_in_backward(
    model: nn.Module | Iterable[nn.Parameter], optimizer_class: type = torch.optim.AdamW, **kwargs
) -> InBackwardOptimizer:
    """Apply ``optimizer_class(**kwargs)`` to each trainable parameter of ``model`` as soon
    as backward has accumulated its gradient, then free that gradient.

    The step's peak then holds one parameter's gradient instead of all of them. What it
    rules out, because no gradient of the whole model ever exists:

    * gradient accumulation over several backwards (a second backward before ``step()``
      raises RuntimeError, before it updates anything);
    * clipping by the global gradient norm (``clip_grad_norm_``): there is no moment with
      every gradient; clip per parameter in a hook of your own if you must;
    * ``DistributedDataParallel``: its all-reduce runs after the gradients are
      accumulated, so each rank would step on its own gradient; refused (TypeError).
      Under FSDP2 the hooks see the unsharded gradients before their reduce-scatter, the
      same problem: not supported.
    * learning-rate schedulers, which take one optimizer: step one per parameter's
      optimizer (``.optimizers.values()``).

    Each parameter's step costs what ``optimizer_class`` costs for that one tensor; a
    parameter used twice in the model (tied embeddings) gets its gradient summed by
    autograd first and is stepped once.
    """
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError(
            "optimizer_in_backward cannot run under DistributedDataParallel: its gradients are all-reduced after "
            "the per-parameter step would have run; use a plain optimizer"
        )
    params = model.parameters() if isinstance(model, nn.Module) else model
    params = [param for param in params if param.requires_grad]
    if not params:
        raise ValueError("optimizer_in_backward: model has no trainable parameters")
    return InBackwardOptimizer(params, lambda group: optimizer_class(group, **kwargs))


def make_optimizer(name: str, params: list[nn.Parameter], **kwargs) -> torch.optim.Optimizer | InBackwardOptimizer:
    """The optimizer ``name`` (one of ``OPTIMIZERS``) over ``params``."""
    check_optimizer(name)
    if name == "adamw-in-backward":
        return optimizer_in_backward(params, torch.optim.AdamW, **kwargs)
    if name == "adamw-fused":
        kwargs["fused"] = True
    return torch.optim.AdamW(params, **kwargs)


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


@dataclasses.dataclass(frozen=True)
class OptimizerCost:
    """What an optimizer costs per trainable parameter tensor of ``n`` bytes, measured:
    state ``state_per_byte * n + state_per_tensor``; a step's temporaries
    ``temp_per_byte * n`` per tensor, combined over the tensors of one step by ``combine``:
    "sum" (all alive at once: foreach) or "carry" (one tensor at a time, but the last
    temporary of the tensor before, ``carry_per_byte`` of its bytes, is still alive while
    the next one's are made: a loop variable rebound only after its next value exists)."""

    name: str
    state_per_byte: float
    state_per_tensor: int
    temp_per_byte: float
    combine: str
    carry_per_byte: float = 0.0

    def state_bytes(self, sizes: list[int]) -> int:
        return round(sum(self.state_per_byte * n + self.state_per_tensor for n in sizes))

    def temporaries(self, sizes: list[int]) -> int:
        """The step's temporaries over tensors of ``sizes`` bytes, in the optimizer's order."""
        if not sizes:
            return 0
        if self.combine == "sum":
            return round(self.temp_per_byte * sum(sizes))
        before = [0, *sizes[:-1]]
        return round(max(self.temp_per_byte * n + self.carry_per_byte * b for n, b in zip(sizes, before)))

    @classmethod
    def measure(cls, name: str, dtype: torch.dtype, device: torch.device) -> "OptimizerCost":
        """Run ``name`` on stand-in parameters of ``dtype`` on ``device`` (1 and 2 Mi
        elements for the state; one alone and three of 1 Mi elements for the temporaries)
        and read its state and its second step's temporaries off them."""
        check_optimizer(name)
        step_name = "adamw" if name == "adamw-in-backward" else name  # one tensor per step in backward

        def stand_ins(*numels):
            return [nn.Parameter(torch.zeros(n, dtype=dtype, device=device)) for n in numels]

        small, large = (1 << 20, 1 << 21)
        alone, state_small = _one_step(step_name, stand_ins(small))
        _, state_large = _one_step(step_name, stand_ins(large))
        three, _ = _one_step(step_name, stand_ins(small, small, small))
        size = small * torch.empty((), dtype=dtype).element_size()  # bytes of the small stand-in
        state_per_byte = (state_large - state_small) / size  # the large one has twice its bytes
        state_per_tensor = round(state_small - state_per_byte * size)
        temp_per_byte = alone / size
        if name == "adamw-in-backward" or three <= 2.5 * alone:  # the three steps' temporaries were not all alive
            carry = 0.0 if name == "adamw-in-backward" else max(0.0, three / size - temp_per_byte)
            return cls(name, state_per_byte, state_per_tensor, temp_per_byte, "carry", carry)
        return cls(name, state_per_byte, state_per_tensor, temp_per_byte, "sum")


def _one_step(name: str, params: list[nn.Parameter]) -> tuple[int, int]:
    """(the temporaries of a second step of ``name`` over ``params``, its state bytes)."""
    optimizer = make_optimizer(name, params, lr=0.0)
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()  # the state is made
    with peak_memory(params[0].device) as peak:
        optimizer.step()
    return peak.bytes, _storage_bytes(_state_tensors(optimizer))
