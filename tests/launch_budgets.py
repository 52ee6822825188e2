"""What one call of each public op costs the host on the CUDA path, counted on a CPU.

A step whose kernels are short is host-bound, and most of a call's host time is the
number of things it dispatches: Triton launches, torch ops (each an allocation, a view or
a small kernel of its own) and custom ops called through the dispatcher. Those counts do
not need a GPU. Each call in ``CALLS`` runs a public op as a BERT-base step (or a decoder)
calls it, on CPU tensors that take the CUDA launch path
(``tools.compile_report.capture.emulate_cuda``: every Triton launch is recorded, not run),
under ``torch.profiler``, which records the dispatcher's calls without changing which path
an op takes. Per call and phase (forward, backward) it counts:

- ``launches``: Triton kernel launches (an autotuned kernel's once, not once per config the
  capture records);
- ``torch_ops``: aten ops dispatched at the top level (not inside another aten op),
  those inside slimformer's custom ops included, autograd's own for the call's graph too;
- ``torch_kernels``: those of them that run a kernel of their own on the device (neither
  an allocation, a view nor a query): a memset, a cast, a reduction, a copy;
- ``custom_ops``: slimformer's ``torch.library`` ops called through the dispatcher;
- ``syncs``: host reads of a device value (``_local_scalar_dense``, ``nonzero``), at any depth
  but inside ``_assert_async`` (a device-side assert on a GPU: its CPU kernel reads the flag);
- ``ops``: the aten ops of ``torch_ops`` by name, to read a change by.

``tests/data/launch_budgets.json`` holds the committed counts, and
``tests/test_launch_budgets.py`` fails when a call's counts differ from them: a change in
what a call dispatches is deliberate, and renews the file:

    env -u TRITON_INTERPRET python -m tests.launch_budgets --write

``triton.jit`` picks the interpreter at decoration time, so this runs in a process where
TRITON_INTERPRET is unset before slimformer is imported (the test starts one).
"""

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import slimformer as sf
from slimformer.kernels import matmul
from slimformer.layers.mlm_head import masked_token_loss
from tools.compile_report.capture import H100, emulate_cuda

BUDGETS = Path(__file__).resolve().parent / "data" / "launch_budgets.json"
# Host reads of a device value: on a GPU each waits for the stream.
_SYNCS = ("aten::_local_scalar_dense", "aten::nonzero")
# aten ops that launch nothing on the device: allocations, views, queries, and composites
# (``to``, ``reshape``, ...) that dispatched nothing below them
_NO_KERNEL = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "_unsafe_view", "reshape",
    "transpose", "permute", "expand", "unsqueeze", "squeeze", "t", "slice", "select", "split", "unbind", "as_strided",
    "alias", "detach", "detach_", "lift_fresh", "resolve_conj", "resolve_neg", "promote_types", "result_type",
    "to", "type_as", "contiguous", "numpy_T", "matrix_H", "mT", "expand_as", "view_as",
}  # fmt: skip


def _runs_a_kernel(event) -> bool:
    """Whether the profiled aten op ``event`` launched a device kernel: itself (any op not in
    ``_NO_KERNEL``, whatever it allocates below it: ``cat`` does its copy itself) or an aten
    op below it (a ``to`` that copies)."""
    if event.name.removeprefix("aten::") not in _NO_KERNEL:
        return True
    return any(_runs_a_kernel(child) for child in event.cpu_children if child.name.startswith("aten::"))


def _inside_assert(event) -> bool:
    while event.cpu_parent is not None:
        event = event.cpu_parent
        if event.name == "aten::_assert_async":
            return True
    return False


def _bert_qkv(batch=2, seq=128, heads=12, head_dim=64):
    """q, k, v as head views of one fused (batch, seq, 3 · hidden) bf16 projection."""
    qkv = torch.zeros(batch, seq, 3 * heads * head_dim, dtype=torch.bfloat16, requires_grad=True)
    return qkv.view(batch, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)


def _attention_bert():
    q, k, v = _bert_qkv()
    padding = torch.zeros(q.shape[0], q.shape[2], dtype=torch.bool)
    return lambda: sf.attention(q, k, v, dropout_p=0.1, key_padding_mask=padding)


def _attention_decoder():
    """Llama-style: (batch, seq, heads, head_dim) projections transposed, GQA 32/8, causal."""
    q = torch.zeros(1, 256, 32, 128, dtype=torch.bfloat16, requires_grad=True).transpose(1, 2)
    k, v = (torch.zeros(1, 256, 8, 128, dtype=torch.bfloat16, requires_grad=True).transpose(1, 2) for _ in range(2))
    return lambda: sf.attention(q, k, v, is_causal=True, enable_gqa=True)


def _varlen_attention():
    cu_seqlens = torch.tensor([0, 100, 228, 256], dtype=torch.int32)
    qkv = torch.zeros(256, 36, 64, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv.split(12, dim=1)
    return lambda: sf.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, 128, 128, 0.1)


def _disentangled_attention():
    """DeBERTa-v3-base's layer: c2p + p2c, 256 buckets, padding, dropout."""
    q, k, v = (torch.zeros(2, 128, 12, 64, dtype=torch.bfloat16, requires_grad=True).transpose(1, 2) for _ in range(3))
    pos_key, pos_query = (torch.zeros(12, 512, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    padding = torch.zeros(2, 128, dtype=torch.bool)
    return lambda: sf.disentangled_attention(
        q, k, v, pos_key, pos_query, position_buckets=256, max_relative_positions=512,
        key_padding_mask=padding, query_padding_mask=padding, dropout_p=0.1,
    )  # fmt: skip


def _norm_inputs(rows=256, n_cols=768):
    x, residual = (torch.zeros(rows, n_cols, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    weight = torch.ones(n_cols, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.zeros(n_cols, dtype=torch.bfloat16, requires_grad=True)
    return x, residual, weight, bias


def _layer_norm_bert():
    """BERT's dropout + residual add + LayerNorm after each sublayer."""
    x, residual, weight, bias = _norm_inputs()
    return lambda: sf.layer_norm(x, (768,), weight, bias, residual=residual, dropout_p=0.1)


def _layer_norm_memory_efficient():
    x, residual, weight, bias = _norm_inputs()
    return lambda: sf.layer_norm(
        x, (768,), weight, bias, residual=residual, dropout_p=0.1, memory_efficient=True, return_residual=True
    )


def _rms_norm_decoder():
    x, residual, weight, _ = _norm_inputs(n_cols=4096)
    return lambda: sf.rms_norm(x, (4096,), weight, residual=residual, return_residual=True)


def _dropout_add():
    x, residual, _, _ = _norm_inputs()
    return lambda: sf.dropout_add(x, residual, 0.1)


def _fused_mlp_bert():
    x = torch.zeros(256, 768, dtype=torch.bfloat16, requires_grad=True)
    fc1 = torch.zeros(3072, 768, dtype=torch.bfloat16, requires_grad=True)
    fc2 = torch.zeros(768, 3072, dtype=torch.bfloat16, requires_grad=True)
    b1, b2 = (torch.zeros(n, dtype=torch.bfloat16, requires_grad=True) for n in (3072, 768))
    return lambda: sf.fused_mlp(x, fc1, b1, fc2, b2, "gelu", 0.1)


def _linear_cross_entropy_mlm():
    """The masked-LM head on the labelled rows of a batch (about 15% of 2 x 128)."""
    x = torch.zeros(40, 768, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.zeros(30522, 768, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.arange(40) * 7
    return lambda: sf.linear_cross_entropy(x, weight, None, labels)


def _masked_token_loss_fixed_shape():
    """The masked-LM head's gather at a fixed 48 rows (40 of 2 x 128 labelled) and its loss:
    no host sync (the transform is left out: it is the layers' own calls)."""
    hidden = torch.zeros(2, 128, 768, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.zeros(30522, 768, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.full((2, 128), -100)
    labels.view(-1)[::7][:40] = 5
    return lambda: masked_token_loss(hidden, labels, lambda rows: rows, weight, None, max_labelled_tokens=48)


def _int8_linear():
    x, weight, bias = _inference_linear()
    q_weight, scale = matmul.quantize_per_channel(weight)
    return lambda: matmul.int8_linear(x, q_weight, scale, bias)


def _int8_weight_only_linear():
    x, weight, bias = _inference_linear()
    q_weight, scale = matmul.quantize_per_channel(weight)
    return lambda: matmul.int8_weight_only_linear(x, q_weight, scale, bias)


def _inference_linear():
    return (torch.zeros(256, 768, dtype=torch.float16), torch.randn(3072, 768, dtype=torch.float16),
            torch.zeros(3072, dtype=torch.float16))  # fmt: skip


# name -> setup, which makes the inputs (not counted) and returns the call (counted, with its backward)
CALLS: dict[str, Callable[[], Callable]] = {
    "attention bert (2x12x128x64 bf16, fused qkv, key padding, dropout)": _attention_bert,
    "attention decoder (1x32/8x256x128 bf16, gqa, causal)": _attention_decoder,
    "varlen_attention (3 sequences, 12 heads, d64 bf16, dropout)": _varlen_attention,
    "disentangled_attention (2x12x128x64 bf16, c2p+p2c, padding, dropout)": _disentangled_attention,
    "layer_norm bert (256x768 bf16, residual, dropout)": _layer_norm_bert,
    "layer_norm memory_efficient (256x768 bf16, residual, dropout)": _layer_norm_memory_efficient,
    "rms_norm decoder (256x4096 bf16, residual)": _rms_norm_decoder,
    "dropout_add (256x768 bf16)": _dropout_add,
    "fused_mlp bert (256x768->3072 bf16, gelu, dropout)": _fused_mlp_bert,
    "linear_cross_entropy mlm (40x768->30522 bf16)": _linear_cross_entropy_mlm,
    "masked_token_loss fixed-shape (48 of 2x128 rows, 40 labelled, bf16)": _masked_token_loss_fixed_shape,
    "int8_linear (256x768->3072 fp16)": _int8_linear,
    "int8_weight_only_linear (256x768->3072 fp16)": _int8_weight_only_linear,
}


def _counted(run: Callable) -> tuple[object, dict]:
    """``run()``'s result and the counts of what it dispatched (module docstring)."""
    launches = []
    with emulate_cuda(H100, launches.append), profile(activities=[ProfilerActivity.CPU]) as profiler:
        result = run()
    ops, kernels, custom, syncs = Counter(), 0, 0, 0
    for event in profiler.events():
        syncs += event.name in _SYNCS and not _inside_assert(event)
        parent = event.cpu_parent
        while parent is not None and parent.name.startswith("slimformer::"):  # a custom op's body is its caller's
            parent = parent.cpu_parent
        top_level = parent is None or not parent.name.startswith("aten::")
        if event.name.startswith("slimformer::"):
            custom += top_level
        elif event.name.startswith("aten::") and top_level:
            ops[event.name.removeprefix("aten::")] += 1
            kernels += _runs_a_kernel(event)
    counts = dict(
        launches=sum(not launch.note or launch.note.startswith("autotune config 1/") for launch in launches),
        torch_ops=sum(ops.values()),
        torch_kernels=kernels,
        custom_ops=custom,
        syncs=syncs,
    )
    return result, {**counts, "ops": dict(sorted(ops.items()))}


def measure() -> dict[str, dict[str, dict]]:
    """{call: {"forward": counts, "backward": counts (where the call has one)}} for ``CALLS``:
    each call's second run, as a training step's calls run after the first (what an op
    makes once and keeps, a layout's index say, is not counted), with the leaves' gradients
    None before it, as ``zero_grad`` leaves them."""
    budgets = {}
    for name, setup in CALLS.items():
        call = setup()
        for _ in range(2):
            out, forward = _counted(call)
            budgets[name] = {"forward": forward}
            outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
            if outs:
                grads = [torch.zeros_like(t) for t in outs]
                _, budgets[name]["backward"] = _counted(lambda: torch.autograd.backward(outs, grads))
                _clear_leaf_grads(outs)
    return budgets


def _clear_leaf_grads(outs: list[torch.Tensor]) -> None:
    """Set to None the ``.grad`` of every leaf the graph of ``outs`` reaches."""
    nodes, seen = [t.grad_fn for t in outs], set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            node.variable.grad = None
        nodes += [next_node for next_node, _ in node.next_functions]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.launch_budgets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the counts to tests/data/launch_budgets.json")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("the launches are captured from compiled Triton: unset TRITON_INTERPRET")
    budgets = measure()
    text = json.dumps(budgets, indent=1) + "\n"
    if args.write:
        BUDGETS.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
