"""One-off GPU profile: where a patched BERT-base training step spends host time, and which
calls synchronise the host with the GPU. Usage: python3 host_profile.py OUT_DIR"""

import cProfile
import io
import pstats
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

import slimformer as sf
from bench.gpu_check import model as gm

out = sys.argv[1]
dev = torch.device("cuda")
lines = []


def say(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    lines.append(s)


def host_time(name, step, n=50):
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    say(f"{name}: host {host * 1e6:.1f} us/call (no sync)")


def cprofile(name, step, n=20, top=45):
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    pr.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(top)
        say(f"== cProfile {name} ({n} calls) by {key}")
        say(buf.getvalue())


def syncs(name, step):
    """Every host-GPU synchronisation one call makes, with where it came from."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    seen = {}
    old = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        stack = "".join(f for f in traceback.format_stack(limit=14)[:-2] if "slimformer" in f or "bench" in f)
        seen[stack] = seen.get(stack, 0) + 1

    warnings.showwarning = record
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        step()
    warnings.showwarning = old
    torch.cuda.set_sync_debug_mode(0)
    say(f"== syncs in one call of {name}: {sum(seen.values())}")
    for stack, count in sorted(seen.items(), key=lambda kv: -kv[1]):
        say(f"-- {count} x from:\n{stack}")


torch.manual_seed(0)
x = torch.randn(16384, 768, device=dev, dtype=torch.bfloat16, requires_grad=True)
r = torch.randn_like(x, requires_grad=True)
w = torch.ones(768, device=dev, dtype=torch.bfloat16, requires_grad=True)
b = torch.zeros(768, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
q, k, v = (torch.randn(32, 12, 512, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn_like(q)


@torch.library.custom_op("hostprobe::identity", mutates_args=())
def identity(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


small = torch.randn(8, device=dev)
cases = {
    "torch x.clone()": lambda: small.clone(),
    "python custom op (clone)": lambda: identity(small),
    "sf.layer_norm fwd": lambda: sf.layer_norm(x, (768,), w, b, residual=r, dropout_p=0.1),
    "sf.layer_norm fwd+bwd": lambda: torch.autograd.grad(
        sf.layer_norm(x, (768,), w, b, residual=r, dropout_p=0.1), (x, r, w, b), dy
    ),
    "F.layer_norm fwd+bwd": lambda: torch.autograd.grad(F.layer_norm(x + r, (768,), w, b), (x, r, w, b), dy),
    "sf.attention fwd": lambda: sf.attention(q, k, v, dropout_p=0.1),
    "sf.attention fwd+bwd": lambda: torch.autograd.grad(sf.attention(q, k, v, dropout_p=0.1), (q, k, v), do),
    "sdpa fwd+bwd": lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, dropout_p=0.1), (q, k, v), do),
}
for name, step in cases.items():
    host_time(name, step)
for name in ("sf.layer_norm fwd+bwd", "sf.attention fwd+bwd"):
    syncs(name, cases[name])
    cprofile(name, cases[name], top=30)

base, _ = gm.base_models(dry_run=False)
for column in ("slimformer qkv+mlp", "HF SDPA"):
    model, forward = gm._train_model(base, gm.TRAIN_COLUMNS[column], dev, dry_run=False)
    inputs, _ = gm.training_batch(base.config, 32, 512, False, dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        train_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    train_step()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    say(f"{column} step: host until return {host * 1e3:.1f} ms, wall {wall * 1e3:.1f} ms")
    syncs(f"{column} training step", train_step)
    if column.startswith("slimformer"):
        cprofile(f"{column} training step", train_step, n=3, top=50)
open(f"{out}/host_profile.txt", "w").write("\n".join(lines))
