"""Peak memory of ``from_pretrained`` for a BERT saved float and saved int8 by slimformer.

A randomly initialised ``BertModel`` (BERT-base dims by default) is saved with
``save_pretrained`` twice into a temporary folder: as it is, and after
``slimformer.quantize(model, "int8")``. Each case then runs in a fresh Python process
(so no memory an earlier case freed is reused):

- ``float``: ``AutoModel.from_pretrained(float_dir)``;
- ``int8, saved quantized``: ``AutoModel.from_pretrained(int8_dir)``: transformers builds
  the model on the meta device, slimformer swaps in empty ``Linear8bit`` layers, and the
  int8 weights and scales load straight into them;
- ``int8, quantized on load``: ``from_pretrained(float_dir,
  quantization_config=SlimformerInt8Config("int8"))``: each fp32 weight is read and
  quantized in turn.

Peak: the process's peak resident memory (VmHWM, reset by writing 5 to
/proc/self/clear_refs just before the load, once the model's code is imported) above
its resident memory then, over the load and one read of every byte of the loaded
model's tensors: transformers maps the safetensors file, whose pages become resident
when read (as they are by the first forward). Model: the bytes of the model's tensors.
Linux only.

    python -m bench.quantized_load                      # BERT-base dims
    python -m bench.quantized_load --layers 2 --json    # smaller; JSON on stdout
"""

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slimformer._cli_args import positive_int


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.quantized_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=positive_int, default=12, help="encoder layers (default 12, BERT-base)")
    parser.add_argument("--hidden", type=positive_int, default=768, help="hidden size (default 768; heads of 64)")
    parser.add_argument("--vocab", type=positive_int, default=30522, help="vocabulary size (default 30522)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch

MiB = 2**20
ROOT = Path(__file__).resolve().parents[1]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _release_freed_memory() -> None:
    """Collect garbage and hand the C library's free heap pages back to the system (glibc's
    malloc_trim), so that the load's allocations show in the resident memory instead of
    reusing them unseen."""
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _page_in(model: torch.nn.Module) -> None:
    """Read every byte of the model's tensors, allocating nothing their size (a sum would
    upcast int8). A function, so that no tensor outlives it: one tensor of a mapped file
    keeps the whole mapping resident."""
    for tensor in model.state_dict().values():
        storage = tensor.untyped_storage()
        if storage.nbytes():
            torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage).max()


def _model_bytes(model: torch.nn.Module) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    storages.update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.buffers()})
    return sum(storages.values())


def measure(cases: list[tuple[str, str, str | None]]) -> list[dict]:
    """In this process, one after the other: (name, directory, mode to quantize on load or
    None) -> {name, peak_bytes, model_bytes, seconds}; see the module docstring."""
    from transformers import AutoConfig, AutoModel
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    from slimformer.integrations.hf.quantizer import SlimformerInt8Config

    results = []
    for name, directory, mode in cases:
        options = {} if mode is None else {"quantization_config": SlimformerInt8Config(mode)}
        MODEL_MAPPING[type(AutoConfig.from_pretrained(directory))]  # imports the model's code
        _release_freed_memory()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        start_kib, start = _status_kib("VmRSS"), time.perf_counter()
        model = AutoModel.from_pretrained(directory, **options)
        _page_in(model)
        seconds = time.perf_counter() - start
        peak = (_status_kib("VmHWM") - start_kib) * 1024
        results.append({"name": name, "peak_bytes": peak, "model_bytes": _model_bytes(model), "seconds": seconds})
        del model
    return results


def measure_in_fresh_process(cases: list[tuple[str, str, str | None]]) -> list[dict]:
    """``measure(cases)`` in a new Python process (from the repository root)."""
    code = (
        "import json, sys; "
        "from bench.quantized_load import measure; print(json.dumps(measure(json.loads(sys.argv[1]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cases)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def save_checkpoints(config, directory: Path) -> tuple[Path, Path]:
    """Save a random ``BertModel(config)`` float and int8-quantized; returns the two folders."""
    from transformers import BertModel

    import slimformer

    torch.manual_seed(0)
    model = BertModel(config).eval()
    model.save_pretrained(directory / "float")
    slimformer.quantize(model, "int8")
    model.save_pretrained(directory / "int8")
    return directory / "float", directory / "int8"


def _table(results: list[dict], config) -> str:
    float_peak = next(r["peak_bytes"] for r in results if r["name"] == "float")
    lines = [
        f"BertModel: {config.num_hidden_layers} layers, hidden {config.hidden_size}, intermediate "
        f"{config.intermediate_size}, vocab {config.vocab_size}; torch {torch.__version__}",
        f"{'case':<26} {'peak MiB':>9} {'model MiB':>10} {'peak / float':>13} {'seconds':>8}",
    ]
    for r in results:
        lines.append(
            f"{r['name']:<26} {r['peak_bytes'] / MiB:9.1f} {r['model_bytes'] / MiB:10.1f} "
            f"{r['peak_bytes'] / float_peak:13.2f} {r['seconds']:8.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    from transformers import BertConfig

    config = BertConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        intermediate_size=4 * args.hidden,
        vocab_size=args.vocab,
    )
    with tempfile.TemporaryDirectory() as tmp:
        float_dir, int8_dir = map(str, save_checkpoints(config, Path(tmp)))
        cases = [("float", float_dir, None), ("int8, saved quantized", int8_dir, None)]
        cases.append(("int8, quantized on load", float_dir, "int8"))
        results = [result for case in cases for result in measure_in_fresh_process([case])]
    print(json.dumps(results, indent=2) if args.json else _table(results, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
