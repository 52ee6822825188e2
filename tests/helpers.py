"""Shared test helpers: the one assertion that bounds a kernel's error by PyTorch's own,
and the set-up and teardown of one spawned gloo rank."""

import contextlib
import faulthandler
import gc
import os
import sys

import torch

# One unit in the last place at magnitude 1, per dtype: the absolute slack added to
# "2x PyTorch's own error", so a reference that happens to be exact does not demand
# the impossible from a kernel that sums in a different order.
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}

# Recompute policies that run every branch of the layers' code, for the expensive tests:
# the layers branch on "qkv" in policy and "mlp" in policy independently, and "full"
# checkpoints the "none" block, so "qkv" and "mlp" alone run nothing these do not.
BRANCH_COVERING_POLICIES = ("none", "qkv+mlp", "full")

# A BERT-family config small enough for the interpreter and CPU tests (two layers, two heads).
TINY_BERT = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 100,
    "max_position_embeddings": 64,
}


def assert_within_reference_error(name, actual, torch_same_dtype, exact, ulps=4.0, scale=1.0):
    """Assert |actual - exact| <= 2 |torch_same_dtype - exact| + ulps * ULP(dtype) * scale.

    ``exact`` is computed in float64 from the same (rounded) inputs; ``torch_same_dtype``
    is PyTorch's own op in the tensor's dtype; ULP is that of ``actual``'s dtype and
    ``scale`` is raised to max |exact| (pass a larger one where the result is a
    cancellation of larger terms).
    NaN/inf must sit where the exact result has them.
    """
    assert actual.shape == exact.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(exact.shape)}"
    ulp = ULP[actual.dtype]
    actual, torch_same_dtype, exact64 = actual.double(), torch_same_dtype.double(), exact.double()
    finite = torch.isfinite(exact64)
    assert torch.equal(torch.isnan(actual), torch.isnan(exact64)), f"{name}: NaN pattern differs"
    assert torch.equal(actual[~finite].nan_to_num(), exact64[~finite].nan_to_num()), f"{name}: inf differs"
    if not finite.any():
        return
    actual, torch_same_dtype, exact64 = actual[finite], torch_same_dtype[finite], exact64[finite]
    error = (actual - exact64).abs()
    torch_error = (torch_same_dtype - exact64).abs().max().item()
    scale = max(scale, exact64.abs().max().item())
    bound = 2 * torch_error + ulps * ulp * scale
    worst = error.argmax().item()
    assert error.max().item() <= bound, (
        f"{name}: max error {error.max().item():.3g} at flat index {worst} "
        f"(got {actual[worst].item():.6g}, exact {exact64[worst].item():.6g}); "
        f"PyTorch's own error {torch_error:.3g}, bound {bound:.3g}"
    )


def norm_rebuild_error_scales(h, dy, weight, bias, is_rms, eps):
    """Error scales of a norm's (dx, dweight) when x̂ is rebuilt as (y - b) / w from rounded y.

    x̂ then carries half an output ulp of (|x̂| + |b / w|). dx = rstd (g - mean(g) -
    x̂ mean(g x̂)) cancels terms of size rstd |g| (g = dy w); dw = sum over rows of
    dy x̂ adds |dy| (|x̂| + |b / w|) per row. h, dy: float64 (rows, N); weight, bias: (N,).
    """
    h, dy = h.double().flatten(0, -2), dy.double().flatten(0, -2)
    w = weight.double()
    centered = h if is_rms else h - h.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centered.square().mean(-1, keepdim=True) + eps)
    ratio = 0.0 if bias is None else (bias.double() / w).abs()
    dx_scale = (rstd * (dy * w).abs()).max().item()
    dw_scale = (dy.abs() * ((centered * rstd).abs() + ratio)).sum(0).max().item()
    return max(1.0, dx_scale), max(1.0, dw_scale)


@contextlib.contextmanager
def gloo_rank(rank: int, world_size: int, init_file):
    """Run the body as ``rank`` of a gloo process group of ``world_size`` spawned ranks.

    On success the rank leaves through ``os._exit(0)`` once every rank has reached the
    end: a rank that returns normally frees FSDP/DDP state left in reference cycles
    during interpreter finalization, while gloo's threads still run, and that can abort
    the process (``terminate called without an active exception``, pytorch#179291).
    The body's results must be written (and closed) before it ends. An exception leaves
    the normal way, so ``mp.spawn`` reports its traceback; a crash prints every thread's
    Python stack (faulthandler)."""
    import torch.distributed as dist

    faulthandler.enable(all_threads=True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    yield
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
