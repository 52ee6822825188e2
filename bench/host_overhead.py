"""Host time per call of slimformer's ops next to their torch counterparts.

A step whose kernels are short is host-bound: what counts is how long the Python side of
each call takes before it returns, not when the device finishes. This measures that: the
host time of a call queued without a device sync (CUDA), or of the whole call (CPU, where
the op's PyTorch reference runs). Shapes are small by default so that the fixed cost of a
call, not its compute, is what shows; pass ``--large`` for BERT-base-sized tensors.
Without a GPU, ``--emulate sm90`` times slimformer's CUDA path on CPU tensors with every
Triton launch stubbed out (``tools.compile_report.capture.stub_launches``): the host side
of a call up to its launches, which ``tests/test_launch_budgets.py`` counts.

Every measurement alternates with the others of its group in the same process (rounds of
``--calls`` calls each), one thread, so that the medians compare like with like; the
table gives the median and the min–max over the rounds, in µs per call.

    python -m bench.host_overhead                # CUDA if available, else CPU
    python -m bench.host_overhead --device cpu --rounds 30 --calls 100
    python -m bench.host_overhead --large --dtype bfloat16   # on a GPU
    env -u TRITON_INTERPRET python -m bench.host_overhead --emulate sm90   # no GPU needed
"""

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable

from slimformer._cli_args import positive_int


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.host_overhead",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available, else cpu)")
    parser.add_argument(
        "--dtype", default=None, help="float32, float16, bfloat16 (default: bfloat16 on CUDA, else float32)"
    )
    parser.add_argument("--rounds", type=positive_int, default=15, help="rounds per measurement (default 15)")
    parser.add_argument("--calls", type=positive_int, default=50, help="calls per round (default 50)")
    parser.add_argument("--large", action="store_true", help="BERT-base-sized tensors instead of tiny ones")
    parser.add_argument(
        "-k", dest="only", action="append", help="run only the groups whose title contains this (repeatable)"
    )
    parser.add_argument("--threads", type=positive_int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument(
        "--emulate",
        choices=("sm90", "sm80", "sm86"),
        help="CPU tensors take the CUDA path of that GPU, every Triton launch stubbed out (no GPU needed): "
        "slimformer's host side per call (torch's rows stay CPU calls of the same tiny shapes)",
    )
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch
import torch.nn.functional as F


@torch.library.custom_op("slimformer_bench::noop_clone", mutates_args=())
def _noop_clone(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_noop_clone.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("slimformer_bench::noop_clone_autograd", mutates_args=())
def _noop_clone_autograd(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_noop_clone_autograd.register_fake
def _(x):
    return torch.empty_like(x)


def _noop_setup_context(ctx, inputs, output):
    pass


def _noop_backward(ctx, grad):
    return grad


_noop_clone_autograd.register_autograd(_noop_backward, setup_context=_noop_setup_context)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rounds(steps: dict[str, Callable[[], object]], device, rounds: int, calls: int) -> dict[str, list[float]]:
    """µs per call of each step, one list entry per round; the steps take turns round by round."""
    for step in steps.values():  # warm-up: compiles, caches, first allocations
        for _ in range(3):
            step()
    _sync(device)
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                step()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    _sync(device)
    return times


def _groups(device: torch.device, dtype: torch.dtype, large: bool) -> dict[str, dict[str, Callable[[], object]]]:
    import slimformer as sf

    def backward(out):
        out.backward(grad)

    groups = {}

    # a trivial op: the floor of the custom-op machinery itself
    x = torch.randn(8, device=device, dtype=dtype)
    xg = x.clone().requires_grad_()
    grad = torch.ones_like(xg)
    groups["custom op floor"] = {
        "x.clone()": lambda: x.clone(),
        "custom_op clone": lambda: _noop_clone(x),
        "custom_op clone, autograd registered": lambda: _noop_clone_autograd(x),
        "custom_op clone fwd+bwd": lambda: _noop_clone_autograd(xg).backward(grad),
    }

    # fused residual + dropout + LayerNorm
    rows, hidden = (16384, 768) if large else (8, 64)
    h = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(hidden, device=device, dtype=dtype, requires_grad=True)
    b = torch.zeros(hidden, device=device, dtype=dtype, requires_grad=True)
    gy = torch.randn(rows, hidden, device=device, dtype=dtype)

    def sf_norm(p):
        return sf.layer_norm(h, (hidden,), w, b, residual=r, dropout_p=p)

    def torch_norm(p):
        return F.layer_norm(F.dropout(h, p) + r, (hidden,), w, b)

    groups[f"layer_norm ({rows} x {hidden}, residual)"] = {
        "sf.layer_norm fwd": lambda: sf_norm(0.0),
        "sf.layer_norm fwd, dropout 0.1": lambda: sf_norm(0.1),
        "sf.layer_norm fwd+bwd": lambda: sf_norm(0.0).backward(gy),
        "sf.layer_norm fwd+bwd, dropout 0.1": lambda: sf_norm(0.1).backward(gy),
        "F.layer_norm(x + r) fwd": lambda: torch_norm(0.0),
        "F.layer_norm(dropout(x) + r) fwd+bwd, 0.1": lambda: torch_norm(0.1).backward(gy),
    }

    # attention
    shape = (32, 12, 512, 64) if large else (1, 1, 16, 16)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    go = torch.randn(shape, device=device, dtype=dtype)

    def sf_attention(p):
        return sf.attention(q, k, v, dropout_p=p)

    def sdpa(p):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p)

    groups[f"attention {shape}"] = {
        "sf.attention fwd": lambda: sf_attention(0.0),
        "sf.attention fwd, dropout 0.1": lambda: sf_attention(0.1),
        "sf.attention fwd+bwd": lambda: sf_attention(0.0).backward(go),
        "sf.attention fwd+bwd, dropout 0.1": lambda: sf_attention(0.1).backward(go),
        "SDPA fwd": lambda: sdpa(0.0),
        "SDPA fwd+bwd": lambda: sdpa(0.0).backward(go),
        "SDPA fwd+bwd, dropout 0.1": lambda: sdpa(0.1).backward(go),
    }

    # MLP with the activation recomputed, and the masked-LM head's fused cross-entropy
    tokens, embed, inner, vocab = (16384, 768, 3072, 30522) if large else (8, 32, 64, 96)
    xm = torch.randn(tokens, embed, device=device, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(inner, embed, device=device, dtype=dtype) / embed**0.5).requires_grad_()
    b1 = torch.zeros(inner, device=device, dtype=dtype, requires_grad=True)
    w2 = (torch.randn(embed, inner, device=device, dtype=dtype) / inner**0.5).requires_grad_()
    b2 = torch.zeros(embed, device=device, dtype=dtype, requires_grad=True)
    gm = torch.randn(tokens, embed, device=device, dtype=dtype)
    head = (torch.randn(vocab, embed, device=device, dtype=dtype) / embed**0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device)

    groups[f"MLP and LM head ({tokens} x {embed}, inner {inner}, vocab {vocab})"] = {
        "sf.fused_mlp fwd+bwd": lambda: sf.fused_mlp(xm, w1, b1, w2, b2, activation="gelu").backward(gm),
        "torch MLP fwd+bwd": lambda: F.linear(F.gelu(F.linear(xm, w1, b1)), w2, b2).backward(gm),
        "sf.linear_cross_entropy fwd+bwd": lambda: sf.linear_cross_entropy(xm, head, None, labels).backward(),
        "F.cross_entropy(linear) fwd+bwd": lambda: F.cross_entropy(F.linear(xm, head).float(), labels).backward(),
    }
    return groups


def _table(title: str, rows: list[tuple[str, str, str, str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for row in rows:
            print("  " + " | ".join(row))
        return
    table = Table(title=title)
    for column in ("group", "call", "µs/call (median)", "min–max"):
        table.add_column(column, justify="left" if column in ("group", "call") else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=max(Console().width, 120)).print(table)


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if args.emulate and args.large:
        parser.error("--emulate times the host side: --large would time the CPU's memsets and GEMMs around it")
    if args.emulate and (interpreted or args.device not in (None, "cpu")):
        parser.error(
            "--emulate runs CPU tensors through compiled Triton's launchers: unset TRITON_INTERPRET, no --device"
        )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.emulate else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" or args.emulate else "float32"))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (PyTorch references)"
    if interpreted and device.type == "cpu":
        name = "CPU (Triton interpreter)"
    with contextlib.ExitStack() as stack:
        if args.emulate:
            from tools.compile_report.capture import DEVICES, stub_launches

            stack.enter_context(stub_launches(DEVICES[args.emulate]))
            name = f"the CUDA path of {DEVICES[args.emulate].name} emulated on a CPU, launches stubbed"
        rows = _measure(args, device, dtype)
    sync = "host time, no sync" if device.type == "cuda" else "whole call"
    _table(
        f"host time per call: {name}, {dtype}, torch {torch.__version__}, {args.threads} thread(s), "
        f"{args.rounds} rounds x {args.calls} calls ({sync})",
        rows,
    )


def _measure(args, device: torch.device, dtype: torch.dtype) -> list[tuple[str, str, str, str]]:
    rows = []
    for title, steps in _groups(device, dtype, args.large).items():
        if args.only and not any(part in title for part in args.only):
            continue
        times = _rounds(steps, device, args.rounds, args.calls)
        for index, (step, values) in enumerate(times.items()):
            spread = f"{min(values):.1f}–{max(values):.1f}"
            rows.append((title if index == 0 else "", step, f"{statistics.median(values):.1f}", spread))
    return rows


if __name__ == "__main__":
    main()
