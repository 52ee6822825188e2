"""Derived figures of the compile report: estimates from compiled code, not timings.

The model (documented in the report, stated here once):

- Instruction issue: each SM has 4 schedulers issuing at most one warp-instruction per
  clock, so a device issues ``4 × SMs × clock`` warp-instructions per second (H100 SXM:
  4 × 132 × 1.755 GHz = 927 G/s); a launch with fewer programs than SMs gets only as
  many SMs (likewise for the tensor cores), and the work is spread evenly. A kernel's dynamic warp-instructions are estimated
  from its SASS: straight-line code once per program, each innermost loop once per
  iteration (attention: one iteration per score tile the program visits; elementwise:
  one per BLOCK-sized chunk), times num_warps.
- Tensor cores: the MMA FLOPs in the SASS of the hot loop (wgmma ``m64nNk16`` per
  warpgroup, mma.sync ``m16n8k16`` per warp, ...) per iteration, at the published dense
  peak (H100 989 TFLOP/s fp16/bf16, twice that for int8).
- Memory: every tensor a kernel is handed is read or written once (an ideal L2), at the
  published HBM bandwidth (H100 3.35 TB/s).

An estimate is max(issue, tensor, memory) time: an upper bound on speed, blind to
latency, occupancy, bank conflicts and the tail. ``bound`` names the largest term.
"""

import math
from dataclasses import dataclass

from tools.compile_report.capture import Device, Launch
from tools.compile_report.cases import allowed_pairs, allowed_tiles
from tools.compile_report.sass import KernelStats

TILE = 128  # the issue's unit: warp-instructions per 128 × 128 score tile


def issue_rate(device: Device, launch: Launch | None = None) -> float:
    """Warp-instructions per second the device issues (only as many SMs as the launch has programs)."""
    sms = device.multiprocessors if launch is None else min(device.multiprocessors, programs(launch))
    return 4 * sms * device.clock_ghz * 1e9


def busy_fraction(device: Device, launch: Launch) -> float:
    return min(device.multiprocessors, programs(launch)) / device.multiprocessors


def tensor_peak(stats: KernelStats, device: Device) -> float:
    int8 = any(op.startswith(("IMMA", "IGMMA")) for op in stats.mma_opcodes)
    return device.dense_16bit_tflops * 1e12 * (2 if int8 else 1)


def programs(launch: Launch) -> int:
    return math.prod(launch.grid)


def block(launch: Launch, name: str) -> int | None:
    value = launch.named_constexprs().get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def kernel_bytes(launch: Launch) -> int:
    return sum(launch.tensor_bytes.values())


def tile_instructions(launch: Launch, stats: KernelStats) -> float | None:
    """Hot-loop warp-instructions per 128 × 128 tile: hot SASS × warps × tiles per 128²."""
    block_m, block_n = block(launch, "BLOCK_M"), block(launch, "BLOCK_N")
    if stats.hot_loop is None or not block_m or not block_n:
        return None
    return stats.hot_loop.instructions * stats.num_warps * (TILE / block_m) * (TILE / block_n)


def _straight_line(stats: KernelStats) -> int:
    return stats.sass_instructions - sum(loop.instructions for loop in stats.loops)


def elementwise_warp_instructions(launch: Launch, stats: KernelStats, elements: int) -> float:
    """Dynamic warp-instructions of an elementwise launch over ``elements`` elements."""
    per_program = elements / programs(launch)
    chunk = math.prod(v for k, v in launch.named_constexprs().items() if k.startswith("BLOCK") and isinstance(v, int))
    trips = max(1, math.ceil(per_program / max(chunk, 1)))
    per_program_instructions = _straight_line(stats) + sum(loop.instructions for loop in stats.loops) * trips
    return per_program_instructions * stats.num_warps * programs(launch)


@dataclass
class Estimate:
    issue_s: float
    tensor_s: float
    memory_s: float
    useful_flops: float = 0.0

    @property
    def time_s(self) -> float:
        return max(self.issue_s, self.tensor_s, self.memory_s)

    @property
    def bound(self) -> str:
        terms = {"issue": self.issue_s, "tensor": self.tensor_s, "memory": self.memory_s}
        return max(terms, key=terms.get)

    @property
    def tflops(self) -> float:
        return self.useful_flops / self.time_s / 1e12 if self.time_s else 0.0

    def __add__(self, other: "Estimate") -> "Estimate":
        return Estimate(
            self.issue_s + other.issue_s,
            self.tensor_s + other.tensor_s,
            self.memory_s + other.memory_s,
            self.useful_flops + other.useful_flops,
        )


def elementwise_estimate(launch: Launch, stats: KernelStats, elements: int, device: Device) -> Estimate:
    issue = elementwise_warp_instructions(launch, stats, elements) / issue_rate(device, launch)
    return Estimate(issue, 0.0, kernel_bytes(launch) / (device.hbm_tbytes_per_s * 1e12))


def attention_tiles(launch: Launch, params: dict) -> int | None:
    """Score tiles (BLOCK_M queries × BLOCK_N keys) the launch visits over all heads."""
    block_m, block_n = block(launch, "BLOCK_M"), block(launch, "BLOCK_N")
    if not block_m or not block_n:
        return None
    per_head = allowed_tiles(params["seq_q"], params["seq_k"], block_m, block_n, params["causal"])
    return per_head * params["batch"] * params["heads"]


def attention_estimate(launch: Launch, stats: KernelStats, params: dict, device: Device) -> Estimate:
    """One attention launch: tile kernels by their hot loop, the rest as elementwise."""
    memory = kernel_bytes(launch) / (device.hbm_tbytes_per_s * 1e12)
    tiles = attention_tiles(launch, params)
    if stats.hot_loop is None or tiles is None:
        rows = params["batch"] * params["heads"] * params["seq_q"] * params["head_dim"]
        return Estimate(elementwise_warp_instructions(launch, stats, rows) / issue_rate(device, launch), 0.0, memory)
    loop = tiles * stats.hot_loop.instructions * stats.num_warps
    outside = programs(launch) * (stats.sass_instructions - stats.hot_loop.instructions) * stats.num_warps
    tensor = tiles * stats.hot_loop_mma_flops / (tensor_peak(stats, device) * busy_fraction(device, launch))
    return Estimate((loop + outside) / issue_rate(device, launch), tensor, memory)


def attention_useful_flops(params: dict, phase: str) -> float:
    """2 GEMMs forward (QKᵀ, PV), 5 backward (QKᵀ, dO Vᵀ, Pᵀ dO, dSᵀ Q, dS K)."""
    pairs = allowed_pairs(params["seq_q"], params["seq_k"], params["causal"])
    gemms = 2 if phase == "fwd" else 5
    return 2.0 * gemms * pairs * params["head_dim"] * params["batch"] * params["heads"]


def attention_min_bytes(params: dict, phase: str, element_size: int) -> float:
    """Forward: read q, k, v, write o and the fp32 lse. Backward: read q, k, v, o, dO and
    lse, write dq, dk, dv."""
    b, h, hk, d = params["batch"], params["heads"], params["kv_heads"], params["head_dim"]
    q_like = b * h * params["seq_q"] * d * element_size
    kv_like = b * hk * params["seq_k"] * d * element_size
    lse = b * h * params["seq_q"] * 4
    if phase == "fwd":
        return 2 * q_like + 2 * kv_like + lse
    return 4 * q_like + 4 * kv_like + lse


def attention_mma_flops(launch: Launch, stats: KernelStats, params: dict) -> float:
    tiles = attention_tiles(launch, params)
    return 0.0 if tiles is None or stats.hot_loop is None else tiles * stats.hot_loop_mma_flops


def norm_backward_min_bytes(params: dict) -> float:
    """What a norm's backward must move: read dy (and the returned h's gradient), the saved
    activation, the weights and the fp32 row statistics; write dx (and a separate
    dresidual when dropout makes them differ), dw and db."""
    element = 4 if params["dtype"] == "fp32" else 2
    rows, cols = params["rows"], params["n_cols"]
    tensors = 3 + bool(params.get("return_residual")) + bool(params["residual"] and params["dropout"])
    weights = (2 if params["kind"] == "layer" else 1) * 2 * cols * element  # w, b and their gradients
    statistics = (2 if params["kind"] == "layer" else 1) * rows * 4
    return tensors * rows * cols * element + weights + statistics
