"""One-off GPU profile: where the slimformer norm / attention steps spend host and device time."""
import cProfile, io, pstats, sys, time
import torch
import torch.nn.functional as F
import slimformer as sf

dev = torch.device("cuda")
torch.manual_seed(0)
out = sys.argv[1]
lines = []
def say(*a):
    s = " ".join(str(x) for x in a); print(s, flush=True); lines.append(s)

def host_and_gpu(name, step, n=50):
    for _ in range(5): step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): step()
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): step()
    e.record(); e.synchronize()
    say(f"{name}: host {host*1e6:.1f} us/call (no sync), wall {wall*1e6:.1f} us/call, back-to-back events {s.elapsed_time(e)/n*1e3:.1f} us/call")

def profile(name, step):
    for _ in range(3): step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10): step()
        torch.cuda.synchronize()
    say(f"== profiler {name} (10 calls)")
    say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=70))
    try:
        say(prof.key_averages().table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=70))
    except Exception as e:
        say(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=70))
    pr = cProfile.Profile(); pr.enable()
    for _ in range(20): step()
    torch.cuda.synchronize(); pr.disable()
    buf = io.StringIO(); pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(30)
    say(f"== cProfile {name} (20 calls)"); say(buf.getvalue())

rows, hidden = 4096, 768
def t(*shape, scale=1.0, offset=0.0):
    return (offset + scale * torch.randn(*shape, device=dev)).bfloat16().requires_grad_()
x, r, w, b = t(rows, hidden), t(rows, hidden), t(hidden, scale=0.1, offset=1.0), t(hidden, scale=0.1)
dy = torch.randn_like(x)
leaves = [x, r, w, b]
norm = sf.LayerNorm(hidden, device=dev, dtype=torch.bfloat16)
tnorm = torch.nn.LayerNorm(hidden, device=dev, dtype=torch.bfloat16)
cases = {
    "torch add+layer_norm fwd+bwd": lambda: torch.autograd.grad(F.layer_norm(x + r, (hidden,), w, b), leaves, dy),
    "sf.layer_norm(memory_efficient=True) fwd+bwd": lambda: torch.autograd.grad(sf.layer_norm(x, (hidden,), w, b, residual=r, memory_efficient=True), leaves, dy),
    "sf.layer_norm(memory_efficient=False) fwd+bwd": lambda: torch.autograd.grad(sf.layer_norm(x, (hidden,), w, b, residual=r), leaves, dy),
    "sf.layer_norm fwd only": lambda: sf.layer_norm(x, (hidden,), w, b, residual=r),
    "nn.LayerNorm(x) fwd+bwd": lambda: torch.autograd.grad(tnorm(x), [x], dy),
    "sf.LayerNorm(x) fwd+bwd": lambda: torch.autograd.grad(norm(x), [x], dy),
}
for name, step in cases.items():
    host_and_gpu(name, step)
profile("sf.layer_norm(memory_efficient=True) fwd+bwd", cases["sf.layer_norm(memory_efficient=True) fwd+bwd"])
profile("sf.layer_norm(memory_efficient=False) fwd+bwd", cases["sf.layer_norm(memory_efficient=False) fwd+bwd"])

q, k, v = (torch.randn(32, 32, 512, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn_like(q)
acases = {
    "sdpa fwd": lambda: F.scaled_dot_product_attention(q, k, v),
    "sf.attention fwd": lambda: sf.attention(q, k, v),
    "sdpa fwd+bwd": lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), do),
    "sf.attention fwd+bwd": lambda: torch.autograd.grad(sf.attention(q, k, v), (q, k, v), do),
}
for name, step in acases.items():
    host_and_gpu(name, step)
profile("sf.attention fwd+bwd", acases["sf.attention fwd+bwd"])
open(out, "w").write("\n".join(lines))
