"""Which norms may keep their output instead of their input for backward: the policy of
the layers' memory-efficient mode, and its handling of FSDP2.

The norm kernel can rebuild x̂ = (y - b) / w from its output y in backward instead of
keeping its input (``slimformer.kernels.norm``), which is exact enough only for weights
that ``output_rebuilds_input`` accepts. Judging the weights reads them (a host sync);
``MEMORY_MODES`` judges every norm whose weights changed at once, with one sync per step
for the whole model, and remembers the verdicts until the weights change again. The
layers (``slimformer.LayerNorm``, ``slimformer.RMSNorm``, the fused BERT-family layer's
two LayerNorms) ask it on every call that records a graph and pass the answer to
``fused_norm`` as ``memory_efficient``.
"""

import sys
import weakref

import torch

from slimformer.kernels.norm import output_rebuilds_input_flag

__all__ = ["MEMORY_MODES", "MemoryModes"]


class MemoryModes:
    """Which norms may keep their output instead of their input, re-decided whenever their
    weights change, with one host sync per device for every stale norm at once.

    A norm (any module with ``weight`` and optionally ``bias``) is stale when its weight
    or bias is another tensor, or has been written in place (its version counter, read
    without a sync, moved): an optimizer step, ``load_state_dict``, pruning's recomputed
    weight, ``with torch.no_grad(): w.zero_()``. The first stale norm that runs after an
    optimizer step re-decides all of them, so a training step costs one sync for the
    whole model, not one per layer. Writes through ``.data`` bypass the version counter:
    call ``refresh`` after those. Code traced by ``torch.compile`` cannot read version
    counters: it uses the decision last made in eager mode (kept on the norm as a bool
    attribute, which the compiled code guards on), or keeps the input if there was none.

    Under FSDP2 (``fully_shard``) a norm runs on an unsharded parameter that the
    all-gather refills every step without moving its version counter, while the optimizer
    writes the sharded DTensor, so a norm whose weights FSDP2 manages is also stale when
    its sharded parameters moved. When one such norm runs stale, every norm on its device
    mesh is re-decided at once: each rank judges the tensors it holds (the unsharded
    weights of the groups gathered now, its local shards of the others, cast to the
    mixed-precision dtype they will be gathered in), one ``all_reduce(MIN)`` over the
    mesh combines the verdicts, and the same single host sync reads them. That is one
    sync and one small collective per optimizer step for the whole model, made inside a
    forward that FSDP2 already requires every rank to run. A norm holding tensor
    subclasses (sharded DTensors between FSDP2 calls, tensor-parallel weights) keeps its
    input when run that way, and is never judged for a query such as ``saves_output``,
    so printing a model on one rank starts no collective. Every rank must see the same
    staleness (SPMD writes: the optimizer, DTensor ops, DCP loading on all ranks): after
    writing one rank's local shard alone (``to_local()``), call ``refresh`` for those
    norms on every rank. FSDP2's parameter records are private: where they cannot be
    read, norms under FSDP2 keep their input.
    """

    _ATTRIBUTE = "_slimformer_rebuilds_input"

    def __init__(self) -> None:
        self._decisions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # norm -> held tensors, or None

    def track(self, norm) -> None:
        """Have ``norm`` decided with the next refresh (so a model's first step decides
        all its norms with one sync)."""
        self._decisions.setdefault(norm, None)

    def _is_current(self, norm) -> bool:
        held = self._decisions.get(norm)
        return held is not None and all(
            (tensor is None) if h is None else (tensor is not None and h.is_current(tensor))
            for h, tensor in zip(held, _weights(norm))
        )

    def rebuilds_input(self, norm) -> bool:
        """Whether ``norm``'s backward may rebuild its input from its output now."""
        if torch.compiler.is_compiling():
            return getattr(norm, self._ATTRIBUTE, False)
        if _has_subclass_weights(norm):
            return False
        if not self._is_current(norm):
            self.refresh(norm)
        return getattr(norm, self._ATTRIBUTE)

    def refresh(self, *norms) -> None:
        """Re-decide ``norms`` and every other stale norm (FSDP2's: those on the meshes of
        ``norms``, a collective every rank of them must join): one host sync per device."""
        for norm in norms:
            self.track(norm)
        fsdp_params = _fsdp2_params_by_module()
        asked = {id(norm) for norm in norms}
        meshes = {_mesh_key(norm, fsdp_params[id(norm)]) for norm in norms if fsdp_params and id(norm) in fsdp_params}
        local, by_mesh = [], {}  # (norm, flag, held) judged here; mesh key -> the same, to combine over ranks
        for norm in list(self._decisions):
            records = None if fsdp_params is None else fsdp_params.get(id(norm), {})
            if records:
                mesh = _mesh_key(norm, records)
                if mesh is None:
                    if id(norm) in asked or not self._is_current(norm):
                        self._decide(norm, False, _held(norm, records))
                elif mesh in meshes:
                    by_mesh.setdefault(mesh, []).append((norm, *_judge_fsdp_norm(norm, records)))
            elif id(norm) in asked or not self._is_current(norm):
                weight, bias = _weights(norm)
                if (weight is not None and weight.is_meta) or _has_subclass_weights(norm) or fsdp_params is None:
                    self._decide(norm, False, _held(norm, {}))
                else:
                    local.append((norm, output_rebuilds_input_flag(weight, bias), _held(norm, {})))
        by_device: dict[torch.device, list] = {}
        for norm, flag, held in local:
            by_device.setdefault(flag.device, []).append(([(norm, held)], flag.view(1)))
        for (_, mesh, dims), judged in by_mesh.items():
            device = _mesh_device(mesh)
            flags = _all_ranks_agree(torch.stack([flag.to(device) for _, flag, _ in judged]), mesh, dims)
            by_device.setdefault(flags.device, []).append(([(norm, held) for norm, _, held in judged], flags))
        for parts in by_device.values():
            flags = torch.cat([flags.bool() for _, flags in parts]).tolist()  # the one host sync
            for (norm, held), ok in zip((pair for pairs, _ in parts for pair in pairs), flags):
                self._decide(norm, ok, held)

    def _decide(self, norm, rebuilds: bool, held: tuple) -> None:
        self._decisions[norm] = held
        setattr(norm, self._ATTRIBUTE, rebuilds)


def _weights(norm) -> tuple:
    return norm.weight, getattr(norm, "bias", None)


def _is_subclass(tensor) -> bool:
    return type(tensor) not in (torch.Tensor, torch.nn.Parameter)


def _has_subclass_weights(norm) -> bool:
    return any(t is not None and _is_subclass(t) for t in _weights(norm))


class _Held:
    """A plain weight or bias as decided on: stale once it is another tensor or was
    written in place."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = weakref.ref(tensor), tensor._version

    def is_current(self, tensor: torch.Tensor) -> bool:
        return self.tensor() is tensor and tensor._version == self.version


class _HeldByFsdp:
    """A weight or bias that FSDP2 manages (``record``: its ``FSDPParam``), as decided on:
    stale once its sharded parameter is another DTensor or was written in place (the
    DTensor's version moves with the optimizer's writes, its local tensor's with writes
    through ``to_local()``), or once the unsharded parameter the norm runs on was. The
    unsharded parameter is the gathered copy of what was judged the first time the norm
    runs on it after the decision; its version is taken then."""

    __slots__ = ("record", "sharded", "versions", "unsharded")

    def __init__(self, record, tensor) -> None:
        self.record, self.sharded = weakref.ref(record), weakref.ref(record.sharded_param)
        self.versions = _sharded_versions(record.sharded_param)
        self.unsharded = None if tensor is None or _is_subclass(tensor) else _Held(tensor)

    def is_current(self, tensor) -> bool:
        record = self.record()
        if record is None or record.sharded_param is not self.sharded():
            return False
        if _sharded_versions(record.sharded_param) != self.versions:
            return False
        if tensor is record.sharded_param:
            return True
        if self.unsharded is None and tensor is getattr(record, "_unsharded_param", None):
            self.unsharded = _Held(tensor)
        return self.unsharded is not None and self.unsharded.is_current(tensor)


def _sharded_versions(sharded) -> tuple[int, int]:
    return sharded._version, sharded._local_tensor._version


def _held(norm, records: dict) -> tuple:
    """What a decision on ``norm`` holds for its weight and bias (FSDP2's records by name)."""
    return tuple(
        None if tensor is None else _HeldByFsdp(records[name], tensor) if name in records else _Held(tensor)
        for name, tensor in zip(("weight", "bias"), _weights(norm))
    )


def _mesh_key(norm, records: "_FsdpRecords") -> tuple | None:
    """(FSDP2 tree, device mesh, the mesh dims to combine local verdicts over) that
    ``norm``'s FSDP2-managed weight and bias share; None when they cannot be judged
    together (one of them not managed, different meshes or placements, a partial
    placement). The tree is part of the key because a collective may only count norms
    that every rank holds: those of the model running now, not those of a dead model
    whose FSDP2 state one rank's garbage collector has freed and another's not yet."""
    if set(records) != {name for name, t in zip(("weight", "bias"), _weights(norm)) if t is not None}:
        return None
    sharded = [record.sharded_param for record in records.values()]
    first = sharded[0]
    if any(s.device_mesh != first.device_mesh or s.placements != first.placements for s in sharded):
        return None
    if any(p.is_partial() for p in first.placements):
        return None
    return records.tree, first.device_mesh, tuple(d for d, p in enumerate(first.placements) if not p.is_replicate())


def _judge_fsdp_norm(norm, records: dict) -> tuple[torch.Tensor, tuple]:
    """(this rank's verdict as a 0-d bool tensor, the held tensors) for a norm under FSDP2:
    its unsharded weights when it holds them, else its local shards in the dtype the
    all-gather will give them (the verdict is elementwise, so shards can be judged apart)."""
    tensors = _weights(norm)
    if not any(t is not None and _is_subclass(t) for t in tensors):
        return output_rebuilds_input_flag(*tensors), _held(norm, records)
    if not all(t is None or _is_subclass(t) for t in tensors):
        return torch.tensor(False), _held(norm, records)
    weight, bias = (_local_shard(records[name]) if name in records else None for name in ("weight", "bias"))
    return output_rebuilds_input_flag(weight, bias), _held(norm, records)


def _local_shard(record) -> torch.Tensor:
    local = record.sharded_param.to_local()
    dtype = getattr(record, "param_dtype", None)
    return local if dtype is None else local.to(dtype)


def _all_ranks_agree(flags: torch.Tensor, mesh, dims: tuple) -> torch.Tensor:
    """``flags`` (bool, on the mesh's device) and-ed over the ranks of ``mesh`` along ``dims``."""
    import torch.distributed as dist

    flags = flags.to(torch.int32)
    for dim in dims:
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=mesh.get_group(dim))
    return flags


def _mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


class _FsdpRecords(dict):
    """One module's FSDP2 parameter records (``FSDPParam``) by parameter name, and the
    FSDP2 tree that runs them (the id of the state context that the root shares with
    every state under it)."""

    __slots__ = ("tree",)

    def __init__(self, tree: int) -> None:
        super().__init__()
        self.tree = tree


def _fsdp2_params_by_module() -> dict[int, _FsdpRecords] | None:
    """FSDP2's per-parameter records by id of the module that uses them; {} when FSDP2
    is not in use, None when it is but its records cannot be read (a torch whose
    internals moved): norms then keep their input rather than guess."""
    fsdp_state = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_state")
    if fsdp_state is None:
        return {}
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.tensor import DTensor

        states = {id(s): s for s in (ref() for ref in list(_module_state_mapping.values()))}
        by_module: dict[int, _FsdpRecords] = {}
        for state in states.values():
            if not isinstance(state, fsdp_state.FSDPState):
                continue
            for group in state._fsdp_param_groups:
                for record in group.fsdp_params:
                    if not isinstance(record.sharded_param, DTensor):
                        return None
                    info = record._module_info
                    names = (info.param_name, *info.shared_param_names)
                    for module, name in zip((info.module, *info.shared_modules), names, strict=True):
                        by_module.setdefault(id(module), _FsdpRecords(id(state._state_ctx)))[name] = record
        return by_module
    except (AttributeError, ImportError, TypeError, ValueError):
        return None


MEMORY_MODES = MemoryModes()
