"""Masked-LM training of a slimformer-patched BERT under HuggingFace's ``Trainer``, on one
process or under ``torchrun`` with DDP.

    python examples/trainer_mlm.py                               # one process
    torchrun --nproc_per_node 2 examples/trainer_mlm.py          # DDP: gloo on CPU, NCCL on GPUs
    python examples/trainer_mlm.py --steps 20 --recompute qkv+mlp --losses losses.json

The model is a ``BertForMaskedLM`` built from a ``BertConfig`` (random weights, nothing
downloaded), patched with ``slimformer.patch`` before the ``Trainer`` wraps it (DDP wraps
the patched model; the fused masked-LM head computes the loss). The corpus, vocabulary and
masking are ``examples/train_bert_mlm.py``'s (standard-library docstrings, MiniLM's
WordPiece or a word vocabulary), with one difference: every block has the same number of
predicted tokens, so that each rank's mean loss weighs as much as its share of the
batch, and DDP over N processes with ``--batch / N`` sequences each follows the same loss
curve as one process with ``--batch`` (up to float rounding; with ``--dropout 0``, as the
ranks draw their own dropout masks). The blocks are masked once, from ``--seed``, and
read in order, so every run sees the same batches.

The dataset's items are dicts of ``input_ids``, ``attention_mask`` and ``labels``: the
Trainer keeps the columns that the model's ``forward`` names (``remove_unused_columns``),
which the patched model's forward keeps from HF's.
"""

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

from slimformer.layers.policies import POLICIES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arguments import output_file, positive_float, positive_int, probability


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python examples/trainer_mlm.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--hidden", type=positive_int, default=128)
    parser.add_argument("--heads", type=positive_int, default=2)
    parser.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=positive_int, default=16, help="sequences per step, over all processes")
    parser.add_argument("--steps", type=positive_int, default=50)
    parser.add_argument("--dropout", type=probability, default=0.1, help="hidden and attention dropout (BERT's 0.1)")
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--recompute",
        choices=POLICIES,
        default="none",
        metavar="POLICY",
        help=f"recompute policy of the patched layers: {', '.join(POLICIES)} (default none)",
    )
    parser.add_argument("--word-vocab", action="store_true", help="word vocabulary even if MiniLM's tokenizer is there")
    parser.add_argument("--losses", type=output_file, help="write the loss of every step here (JSON), from rank 0")
    parser.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default: a temporary folder)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch
from train_bert_mlm import SPECIALS, build_corpus, build_model, build_vocabulary, minilm_tokenizer_dir, token_blocks

import slimformer as sf

MASK_FRACTION = 0.15


def mask_blocks(blocks: torch.Tensor, mask_id: int, vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking with the same number of predicted tokens in every block (15% of its
    non-special tokens, at least one): (masked input_ids, labels with -100 elsewhere)."""
    generator = torch.Generator().manual_seed(seed)
    special = blocks < len(SPECIALS)
    count = max(1, round(MASK_FRACTION * int((~special[0]).sum())))
    scores = torch.rand(blocks.shape, generator=generator).masked_fill(special, 2.0)
    chosen = torch.zeros_like(blocks, dtype=torch.bool).scatter_(1, scores.argsort(dim=1)[:, :count], True)
    labels = torch.where(chosen, blocks, -100)
    roll = torch.rand(blocks.shape, generator=generator)
    masked = blocks.clone()
    masked[chosen & (roll < 0.8)] = mask_id
    replace = chosen & (roll >= 0.8) & (roll < 0.9)
    masked[replace] = torch.randint(len(SPECIALS), vocab_size, blocks.shape, generator=generator)[replace]
    return masked, labels


class MaskedBlocks(torch.utils.data.Dataset):
    """The masked blocks as the dicts a HF model takes."""

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor):
        self.input_ids, self.labels = input_ids, labels

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.input_ids[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": self.labels[index]}


def make_trainer(args: argparse.Namespace, model, dataset, output_dir: str):
    """A ``Trainer`` that reads the dataset in order (the same batches on 1 or N processes)."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    class InOrderTrainer(Trainer):
        def _get_train_sampler(self, *unused, **unused_kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch % world:
        raise ValueError(f"--batch must be a multiple of the {world} processes, got {args.batch}")
    training = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch // world,
        max_steps=args.steps,
        learning_rate=args.lr,
        warmup_steps=max(1, args.steps // 10),
        weight_decay=0.01,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        dataloader_drop_last=True,
        # HF's BertForMaskedLM averages its loss over its own labels (it takes no
        # num_items_in_batch), so the Trainer's token averaging across processes would
        # multiply it by their count; each rank's mean is already its share here.
        average_tokens_across_devices=False,
        disable_tqdm=args.quiet,
        use_cpu=not torch.cuda.is_available(),
    )
    return InOrderTrainer(model=model, args=training, train_dataset=dataset, data_collator=default_data_collator)


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    paragraphs = build_corpus()
    vocab = build_vocabulary(paragraphs, None if args.word_vocab else minilm_tokenizer_dir())
    input_ids, labels = mask_blocks(token_blocks(paragraphs, vocab, args.seq), vocab.mask_id, vocab.size, args.seed)
    torch.manual_seed(args.seed)
    model, _ = build_model(
        vocab.size, layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, dropout=args.dropout
    )
    model = sf.patch(model, recompute=args.recompute)

    with tempfile.TemporaryDirectory() as scratch:
        trainer = make_trainer(args, model, MaskedBlocks(input_ids, labels), args.output_dir or scratch)
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if trainer.is_world_process_zero():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        print(
            f"{world} process(es), {args.batch} sequences of {args.seq} tokens a step, vocabulary {vocab.name}: "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps"
        )
        if args.losses is not None:
            args.losses.write_text(json.dumps({"world_size": world, "losses": losses}))
            print(f"losses written to {args.losses}")
    if torch.distributed.is_initialized():
        # Leave the process group before the interpreter's exit frees DDP's state: freed
        # then, while gloo's threads still run, it can abort the process (pytorch#179291).
        del trainer, model
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
