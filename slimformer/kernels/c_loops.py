"""Plain C loops over raw pointers, compiled once per machine and called through ctypes.

Where a CPU path's PyTorch statement takes many whole-tensor ops, each a dispatch and a pass
over memory, a loop in C computes the same values in one pass (``int8_cpu``: the W8A8
epilogues; ``philox``: the dropout masks' Philox rounds). The sources use no torch headers,
so a build takes seconds, not the minutes of a torch C++ extension. ``load`` compiles a
source with the C compiler (``$CC``, else ``cc``) for the vector ISA torch uses on this CPU,
with OpenMP where the compiler has it, caches the library under ``$SLIMFORMER_CACHE_DIR``
(default ``~/.cache/slimformer``) and returns it, or None (with one warning) where it cannot
be built: the callers then run the PyTorch statement, which gives the same bits.
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

__all__ = ["load"]

_log = logging.getLogger(__name__)

# -ffp-contract=off: no multiply-add is fused but one written as fmaf.
_CFLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
# Vector ISA flags per torch's CPU capability (not -march=native: the cached library
# must run on every machine of that capability that shares the cache directory).
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def cache_dir() -> Path:
    if os.environ.get("SLIMFORMER_CACHE_DIR"):
        return Path(os.environ["SLIMFORMER_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slimformer"


def _build(name: str, source: str, compiler: str, flags: list[str], target: Path) -> None:
    """Compile ``source`` into ``target``, with OpenMP where the compiler has it. The
    library is written under a temporary name and renamed, so processes building at
    once (pytest-xdist workers, DDP ranks) never load a half-written file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source_file, library = Path(tmp) / f"{name}.c", Path(tmp) / target.name
        source_file.write_text(source)
        command = [compiler, *flags, str(source_file), "-o", str(library)]
        build = subprocess.run([*command[:1], "-fopenmp", *command[1:]], capture_output=True, text=True)
        if build.returncode:  # no OpenMP (e.g. Apple clang): the same loops on one thread
            build = subprocess.run(command, capture_output=True, text=True)
        if build.returncode:
            raise RuntimeError(f"{' '.join(command)} failed: {build.stderr.strip()}")
        os.replace(library, target)


def load(name: str, source: str, signatures: dict[str, list], what: str, fallback: str) -> ctypes.CDLL | None:
    """The library built from ``source`` (functions ``signatures``: name -> ctypes argument
    types, returning nothing), or None with a RuntimeWarning naming ``what`` could not be
    built and that ``fallback`` runs instead."""
    flags = _CFLAGS + _ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    compiler = os.environ.get("CC") or "cc"
    key = "\n".join([source, compiler, *flags, platform.machine(), platform.system()])
    target = cache_dir() / f"{name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    try:
        if not target.exists():
            if shutil.which(compiler) is None:
                raise RuntimeError(f"no C compiler {compiler!r} on PATH")
            _log.info("slimformer: compiling %s into %s (once per machine)", what, target)
            _build(name, source, compiler, flags, target)
        library = ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as error:
        first = str(error).splitlines()[0] if str(error) else ""
        warnings.warn(
            f"slimformer: {what} could not be built ({type(error).__name__}: {first}); {fallback}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    for function, argtypes in signatures.items():
        getattr(library, function).argtypes = argtypes
        getattr(library, function).restype = None
    return library
