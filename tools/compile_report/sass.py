"""Facts about a compiled kernel: ptxas's resource report and its SASS.

``analyse(launch)`` compiles a captured launch (``capture``) with Triton's own
pipeline, ptxas included, and reads:

- from ptxas ``-v`` (Triton always passes it): registers per thread, spill store/load
  bytes, stack frame;
- from the kernel's metadata: dynamic shared memory per program, num_warps, num_stages;
- from ``cuobjdump -sass`` (shipped with Triton): the MMA instructions (``HGMMA`` =
  wgmma, ``HMMA``/``IMMA`` = mma.sync; without them a dot runs as FFMAs), the global loads
  (``UTMALDG`` = TMA, ``LDGSTS`` = cp.async, ``LDG.E.128``/``.64`` = vector,
  ``LDG.E``/``.U16``/``.U8`` = scalar), and the loops: a loop is the address range
  [target, branch] of a branch that jumps backwards; the *hot loop* is the largest
  innermost loop (for the attention kernels, the steady state of the key/query loop).
  Its length counts every SASS instruction in that range, as a warp issues them.

Results are cached on disk by Triton's own cache key (the kernel's source and every
function it calls, the specialisation, the options, the target and ptxas's version)
plus this module's ``ANALYSIS_VERSION``, so an edited kernel is always recompiled.
"""

import contextlib
import functools
import hashlib
import io
import json
import os
import re
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tools.compile_report.capture import Launch, compile_launch, decode_constexpr, load_kernel

ANALYSIS_VERSION = 1
CACHE_DIR = Path(os.environ.get("SLIMFORMER_COMPILE_CACHE", Path.home() / ".cache" / "slimformer-compile-report"))

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH_TARGET = re.compile(r"\bBRA(?:\.\S+)?\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))")
_WGMMA_SHAPE = re.compile(r"^(HGMMA|IGMMA|QGMMA)\.(\d+)x(\d+)x(\d+)")
_MMA_SYNC_SHAPE = re.compile(r"^(HMMA|IMMA)\.(\d+)")


@dataclass
class Instruction:
    address: int
    predicate: str
    opcode: str  # with modifiers, e.g. "LDG.E.128"
    text: str


@dataclass
class Loop:
    start: int
    end: int  # address of the backward branch
    instructions: int
    opcodes: dict = field(default_factory=dict)  # opcode (with modifiers) -> count


@dataclass
class KernelStats:
    """Everything the report tabulates about one compiled launch."""

    kernel: str
    arch: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    shared_bytes: int
    num_warps: int
    num_stages: int
    sass_instructions: int
    mma_opcodes: dict  # whole kernel
    loads: dict  # load class -> count, whole kernel
    loops: list  # innermost loops, largest first
    hot_loop: Loop | None
    hot_loop_loads: dict
    hot_loop_mma_flops: int  # MMA FLOPs one program issues per hot-loop iteration
    ptxas_version: str = ""
    compile_seconds: float = 0.0

    @property
    def mma_kind(self) -> str:
        return mma_kind(self.mma_opcodes)

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "KernelStats":
        data = dict(data)
        data.pop("mma_kind", None)  # derived from mma_opcodes (older cache entries stored it)
        data["loops"] = [Loop(**loop) for loop in data["loops"]]
        # re-derived, so a cached analysis follows the current choice of the hot loop
        data.update(hot_loop_fields(data["loops"], data["num_warps"]))
        return cls(**data)


def triton_bin(name: str) -> str:
    from triton import knobs

    return os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), name)


@functools.cache
def ptxas_version() -> str:
    from triton import knobs

    out = subprocess.run([knobs.nvidia.ptxas.path, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"release (\S+), (V\S+)", out)
    return f"{match.group(1).rstrip(',')} ({match.group(2)})" if match else out.strip().splitlines()[-1]


def parse_sass(sass: str) -> list[Instruction]:
    instructions = []
    for line in sass.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        text = match.group(2).strip()
        predicate = ""
        if text.startswith("@"):
            predicate, text = text.split(None, 1)
        opcode = text.split(None, 1)[0]
        instructions.append(Instruction(int(match.group(1), 16), predicate, opcode, text))
    return instructions


def find_loops(instructions: list[Instruction]) -> list[Loop]:
    """Innermost loops (backward-branch ranges that contain no other), largest first."""
    ranges = []
    for inst in instructions:
        if not inst.opcode.startswith("BRA"):
            continue
        match = _BRANCH_TARGET.search(inst.text)
        if match and match.group(1):
            target = int(match.group(1), 16)
            if target < inst.address:  # a jump to itself is the trap after EXIT
                ranges.append((target, inst.address))
    innermost = [(s, e) for s, e in ranges if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in ranges)]
    loops = []
    for start, end in sorted(set(innermost)):
        body = [i for i in instructions if start <= i.address <= end]
        loops.append(Loop(start, end, len(body), dict(Counter(i.opcode for i in body))))
    return sorted(loops, key=lambda loop: -loop.instructions)


def load_class(opcode: str) -> str | None:
    """A global load's kind: "TMA", "cp.async.128", "LDG.128", "LDG.32", "LDG.16", ..."""
    parts = opcode.split(".")
    if parts[0] in ("UTMALDG", "UBLKCP"):
        return "TMA"
    if parts[0] == "LDGSTS":
        width = next((p for p in parts[1:] if p.isdigit()), "32")
        return f"cp.async.{width}"
    if parts[0] == "LDG":
        width = next((p for p in parts[1:] if p.isdigit()), None)
        if width:
            return f"LDG.{width}"
        if any(p in ("U16", "S16") for p in parts):
            return "LDG.16"
        if any(p in ("U8", "S8") for p in parts):
            return "LDG.8"
        return "LDG.32"
    return None


def _count_loads(opcodes: dict) -> dict:
    loads = Counter()
    for opcode, count in opcodes.items():
        kind = load_class(opcode)
        if kind:
            loads[kind] += count
    return dict(sorted(loads.items()))


def mma_flops(opcode: str, num_warps: int) -> int:
    """FLOPs one program issues with one such instruction (every warp executes it)."""
    match = _WGMMA_SHAPE.match(opcode)
    if match:  # one wgmma per warpgroup of 4 warps
        m, n, k = (int(g) for g in match.groups()[1:])
        return 2 * m * n * k * max(1, num_warps // 4)
    match = _MMA_SYNC_SHAPE.match(opcode)
    if match:
        digits = match.group(2)
        m = 16 if digits.startswith("16") else 8
        rest = digits[2:] if m == 16 else digits[1:]
        n, k = int(rest[0]), int(rest[1:])
        return 2 * m * n * k * num_warps
    return 0


def mma_kind(opcodes: dict) -> str:
    """ "wgmma", "mma.sync", or "–" (no tensor-core instruction: a dot runs as FFMAs)."""
    names = {op.split(".")[0] for op in opcodes}
    if names & {"HGMMA", "IGMMA", "QGMMA"}:
        return "wgmma"
    if names & {"HMMA", "IMMA"}:
        return "mma.sync"
    return "–"


def _parse_ptxas_log(log: str) -> dict:
    def number(pattern):
        match = re.search(pattern, log)
        return int(match.group(1)) if match else 0

    if "Used" not in log:
        raise RuntimeError(f"no ptxas resource report in:\n{log}")
    return dict(
        registers=number(r"Used (\d+) registers"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        stack_frame=number(r"(\d+) bytes stack frame"),
    )


def disassemble(cubin: bytes) -> list[Instruction]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([triton_bin("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True)
    return parse_sass(sass.stdout)


def stats_from_binary(launch: Launch, cubin: bytes | None, ptxas_log: str, metadata) -> KernelStats:
    """The stats of a compiled launch; with ``cubin`` None, those of ptxas's report and the
    metadata only (the SASS fields empty)."""
    instructions = disassemble(cubin) if cubin is not None else []
    opcodes = dict(Counter(i.opcode for i in instructions))
    loops = find_loops(instructions)
    num_warps = metadata.num_warps
    return KernelStats(
        kernel=launch.kernel,
        arch=launch.arch,
        **_parse_ptxas_log(ptxas_log),
        shared_bytes=metadata.shared,
        num_warps=num_warps,
        num_stages=metadata.num_stages,
        sass_instructions=len(instructions),
        mma_opcodes={op: n for op, n in opcodes.items() if mma_flops(op, 1) or op.startswith(("HMMA", "IMMA"))},
        loads=_count_loads(opcodes),
        loops=loops,
        **hot_loop_fields(loops, num_warps),
        ptxas_version=ptxas_version(),
    )


def _loop_mma_flops(loop: Loop, num_warps: int) -> int:
    return sum(mma_flops(op, num_warps) * n for op, n in loop.opcodes.items())


def hot_loop_fields(loops: list[Loop], num_warps: int) -> dict:
    """hot_loop, hot_loop_loads and hot_loop_mma_flops of a kernel's innermost loops.

    The hot loop is the one most tiles run. With tensor-core work it is, among the loops
    issuing the most MMA FLOPs, the one with the fewest instructions: kernels that split
    their key loop run the same MMAs in an unmasked loop (most tiles) and in edge or
    diagonal loops that add the compares. Without MMAs it is the largest loop.
    """
    hot = loops[0] if loops else None
    flops = {id(loop): _loop_mma_flops(loop, num_warps) for loop in loops}
    most = max(flops.values(), default=0)
    if most:
        hot = min((loop for loop in loops if flops[id(loop)] == most), key=lambda loop: loop.instructions)
    return dict(
        hot_loop=hot,
        hot_loop_loads=_count_loads(hot.opcodes) if hot else {},
        hot_loop_mma_flops=flops[id(hot)] if hot else 0,
    )


def cache_key(launch: Launch) -> str:
    """Triton's own cache key for this compilation, plus the analysis version."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import get_cache_key, make_backend
    from triton.runtime.jit import get_cache_invalidating_env_vars

    backend = make_backend(GPUTarget("cuda", launch.arch, 32))
    options = backend.parse_options({k: decode_constexpr(v) for k, v in launch.option_kwargs.items()})
    constexprs = {tuple(p): decode_constexpr(v) for p, v in launch.constexprs}
    attrs = {tuple(p): v for p, v in launch.attrs}
    source = ASTSource(load_kernel(launch), launch.signature, constexprs, attrs)
    key = get_cache_key(source, backend, options, get_cache_invalidating_env_vars())
    return hashlib.sha256(f"{key}-{ANALYSIS_VERSION}".encode()).hexdigest()


def analyse(launch: Launch, use_cache: bool = True, sass: bool = True) -> KernelStats:
    """Compile ``launch`` (ptxas runs every time the cache misses) and read its facts.

    Without ``sass``, only ptxas's report and the metadata (registers, spills, shared
    memory), all that the limit checks read: the SASS fields stay empty, and cuobjdump,
    which takes as long as ptxas, does not run. Such stats are cached apart from full
    ones, and a full cached record serves both.
    """
    from triton import knobs

    key = cache_key(launch)
    full, no_sass = CACHE_DIR / f"{key}.json", CACHE_DIR / f"{key}-no-sass.json"
    path, readable = (full, [full]) if sass else (no_sass, [full, no_sass])
    cached = next((p for p in readable if use_cache and p.exists()), None)
    if cached:
        return KernelStats.from_json(json.loads(cached.read_text()))
    log = io.StringIO()
    start = time.perf_counter()
    with knobs.compilation.scope(), knobs.nvidia.scope():
        # Triton's own cache would skip ptxas, and with it the resource report.
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            compiled = compile_launch(launch)
    stats = stats_from_binary(launch, compiled.asm["cubin"] if sass else None, log.getvalue(), compiled.metadata)
    stats.compile_seconds = time.perf_counter() - start
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(stats.to_json()))
    tmp.replace(path)
    return stats
