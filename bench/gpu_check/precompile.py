"""Keeping the compiles off the clock: worker processes that run each speed case's compiled
providers (slimformer's Triton kernels, ``torch.compile`` baselines, FlexAttention) and
the model phase's ``torch.compile`` column once, while the correctness phase runs, so
their kernels are in Triton's and Inductor's on-disk caches when the timed phases reach
them (the first call then loads instead of compiling; ``Timing.first_call_s`` shows it).

Cases are dealt round-robin in priority order, the model's compile first on worker 0 (the
longest). Workers still running when the speed phase starts are stopped; what they had
not reached compiles on the clock as before.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.gpu_check import ROOT

MODEL_KEY = "model: the compiled columns"


class Precompiler:
    def __init__(self, keys: list[str], workers: int, dry_run: bool):
        self.workers = max(0, min(workers, len(keys)))
        self._dir = Path(tempfile.mkdtemp(prefix="gpu-check-precompile-"))
        self._processes: list[tuple[subprocess.Popen, Path]] = []
        shards = [keys[i :: self.workers] for i in range(self.workers)]
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        for i, shard in enumerate(shards):
            keys_file, log = self._dir / f"keys-{i}.json", self._dir / f"done-{i}.jsonl"
            keys_file.write_text(json.dumps(shard))
            command = [sys.executable, "-m", "bench.gpu_check", "--precompile-worker", str(keys_file)]
            if dry_run:
                command.append("--dry-run")
            with log.open("w") as out, log.with_suffix(".err").open("w") as err:
                process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err)
            self._processes.append((process, log))

    def stop(self) -> dict:
        """Stop the workers that are still running. Returns what they did: {"workers", "results"
        (one record per launch), "stopped_unfinished", "crashed" (the stderr tail of each
        worker that exited with an error)}."""
        results, unfinished, crashed = [], 0, []
        for process, log in self._processes:
            if process.poll() is None:
                unfinished += 1
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            elif process.returncode != 0:
                crashed.append(log.with_suffix(".err").read_text().splitlines()[-8:])
            for line in log.read_text().splitlines():
                try:
                    results.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return {"workers": self.workers, "results": results, "stopped_unfinished": unfinished, "crashed": crashed}


def triton_cache_entries() -> int:
    """Kernels in Triton's on-disk cache (one folder each): counted before the workers start,
    when they stop and after the speed phase, it tells whether the timed phases found the
    workers' kernels there or compiled their own."""
    from triton import knobs

    folder = Path(knobs.cache.dir)
    return sum(1 for entry in folder.iterdir() if entry.is_dir()) if folder.is_dir() else 0


def keys_in_order(case_keys: list[str], with_model: bool) -> list[str]:
    """The model's compile first (the longest, on worker 0), then the cases by priority."""
    return ([MODEL_KEY] if with_model else []) + case_keys


def worker(keys_file: str, dry_run: bool) -> None:
    """A worker's loop: warm each case of its shard, one JSON line per launch on stdout."""
    import torch

    from bench.gpu_check import model
    from bench.gpu_check.cases import warm
    from bench.gpu_check.kernels import all_cases

    device = torch.device("cpu" if dry_run else "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cases = {case.key: case for case in all_cases(dry_run, device, copies=1)}
    for key in json.loads(Path(keys_file).read_text()):
        records = model.warm_compiled(device, dry_run) if key == MODEL_KEY else warm(cases[key], sync)
        for record in records:
            print(json.dumps(record), flush=True)
