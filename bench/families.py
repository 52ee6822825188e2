"""The encoder families after BERT under ``sf.patch``: kept memory and unpadded speed on the CPU.

For each family (BERT as the baseline, DistilBERT, MPNet, ModernBERT, ALBERT), at base-size dimensions
(hidden 768, 12 heads, FFN 3072; ALBERT's embeddings 128; ModernBERT's GeGLU 2 x 1536, its
first layer, a global one, measured alone), random weights, fp32,
dropout 0.1, training mode:

1. **One layer**, seq 512: bytes the layer keeps for backward per token per hidden unit
   (``slimformer.memory.measure_activation_memory``, the larger of its two measurements;
   the layer's inputs, MPNet's position bias among them, and parameters excluded), HF eager
   and SDPA (MPNet has eager only) against the patched layer at ``none`` and ``qkv+mlp``. Targets (issue 26): ``none`` <= 0.25x and
   ``qkv+mlp`` <= 0.08x HF eager.
2. **Whole masked-LM model**, 2 layers, batch 4 x 512, 15% of the tokens labelled: bytes
   one training forward keeps (the loss included), HF eager against ``sf.patch(model,
   recompute="qkv+mlp")``. Target: <= 10% of HF eager.
3. **Unpadded training**, ``*ForSequenceClassification`` at 2 layers on ``bench.unpad``'s
   batch (32 sentences padded to 128, about half padding): forward+backward of the loss,
   one intra-op thread, process CPU time, the two columns interleaved round after round,
   median (min–max); tokens/s = real tokens / time. Target: ``unpad=True`` >= 1.6x the
   padded patched model's tokens/s.

    python -m bench.families [--families BERT,DistilBERT,ALBERT] [--rounds 3] [--out DIR] [--overwrite]

The table goes to the terminal and to ``<out>/cpu-families.md``.
"""

import argparse
import copy
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slimformer._cli_args import positive_int
from tools.results import add_output_arguments, refuse_to_replace, shown

FAMILY_NAMES = ("BERT", "DistilBERT", "MPNet", "ModernBERT", "ALBERT")  # FAMILIES' keys, known before torch


def _family_names(text: str) -> list[str]:
    """An argparse type: a comma-separated subset of FAMILY_NAMES."""
    families = [name.strip() for name in text.split(",") if name.strip()]
    if not families or any(name not in FAMILY_NAMES for name in families):
        raise argparse.ArgumentTypeError(f"expected some of {list(FAMILY_NAMES)}, comma-separated, got {text!r}")
    return families


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.families", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--families",
        type=_family_names,
        default=list(FAMILY_NAMES),
        help=f"comma-separated subset of {list(FAMILY_NAMES)}",
    )
    parser.add_argument("--rounds", type=positive_int, default=3, help="interleaved timing rounds (default 3)")
    add_output_arguments(parser)
    return parser


if __name__ == "__main__":  # --help and usage errors come before the imports below, which load torch
    _parser().parse_args()

import torch
from tqdm.auto import tqdm

import slimformer as sf
from bench.harness import device_name
from bench.unpad import BATCH, MAX_LEN, SPEEDUP, sentence_lengths
from slimformer.memory import measure_activation_memory

SEQ, MLM_LAYERS, MLM_BATCH, LABELLED = 512, 2, 4, 0.15
TARGETS = {"none": 0.25, "qkv+mlp": 0.08}
MLM_TARGET = 0.10
RESULT_FILE = "cpu-families.md"


@dataclass(frozen=True)
class Family:
    """How to build one family's models at base size with ``layers`` layers."""

    config: Callable[[int, str], object]  # (layers, attention implementation) -> config
    base: str  # transformers class names
    masked_lm: str
    classifier: str
    layer: Callable[[torch.nn.Module], torch.nn.Module]  # base model -> its (first) layer
    hidden: int = 768
    # (base model, hidden states) -> the layer's other positional arguments (MPNet: the position bias)
    layer_arguments: Callable[[torch.nn.Module, torch.Tensor], tuple] = lambda model, x: ()


def _bert_config(layers, attn):
    from transformers import BertConfig

    return BertConfig(num_hidden_layers=layers, attn_implementation=attn)


def _distilbert_config(layers, attn):
    from transformers import DistilBertConfig

    return DistilBertConfig(n_layers=layers, dropout=0.1, attention_dropout=0.1, attn_implementation=attn)


def _albert_config(layers, attn):
    from transformers import AlbertConfig

    return AlbertConfig(
        embedding_size=128,
        hidden_size=768,
        num_attention_heads=12,
        intermediate_size=3072,
        num_hidden_layers=layers,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        attn_implementation=attn,
    )


def _mpnet_config(layers, attn):
    from transformers import MPNetConfig

    # mpnet-base: positions count from the padding index + 1, so 512 tokens need 514
    return MPNetConfig(num_hidden_layers=layers, max_position_embeddings=514, attn_implementation="eager")


def _modernbert_config(layers, attn):
    from transformers import ModernBertConfig

    return ModernBertConfig(
        num_hidden_layers=layers,
        hidden_size=768,
        intermediate_size=3072 // 2,
        attention_dropout=0.1,  # the benchmark's dropout (ModernBERT's defaults are 0)
        mlp_dropout=0.1,
        embedding_dropout=0.1,
        attn_implementation=attn,
    )


def _modernbert_layer_arguments(model, x):
    positions = torch.arange(x.shape[1])[None]
    return (None, model.rotary_emb(x, positions, model.config.layer_types[0]))


FAMILIES = {
    "BERT": Family(
        _bert_config, "BertModel", "BertForMaskedLM", "BertForSequenceClassification", lambda m: m.encoder.layer[0]
    ),
    "DistilBERT": Family(
        _distilbert_config,
        "DistilBertModel",
        "DistilBertForMaskedLM",
        "DistilBertForSequenceClassification",
        lambda m: m.transformer.layer[0],
    ),
    "MPNet": Family(
        _mpnet_config,
        "MPNetModel",
        "MPNetForMaskedLM",
        "MPNetForSequenceClassification",
        lambda m: m.encoder.layer[0],
        layer_arguments=lambda model, x: (None, model.encoder.compute_position_bias(x)),
    ),
    "ModernBERT": Family(
        _modernbert_config,
        "ModernBertModel",
        "ModernBertForMaskedLM",
        "ModernBertForSequenceClassification",
        lambda m: m.layers[0],
        layer_arguments=_modernbert_layer_arguments,
    ),
    "ALBERT": Family(
        _albert_config,
        "AlbertModel",
        "AlbertForMaskedLM",
        "AlbertForSequenceClassification",
        lambda m: m.encoder.albert_layer_groups[0].albert_layers[0],
    ),
}


def _build(family: Family, class_name: str, layers: int, attn: str = "eager") -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, class_name)(family.config(layers, attn)).train()


def _kept(memory) -> int:
    return max(memory.saved_bytes, memory.alive_bytes)


def layer_bytes_per_token(family: Family) -> dict[str, float]:
    """Column -> kept bytes per token per hidden unit of one layer at seq ``SEQ``."""
    x = torch.randn(1, SEQ, family.hidden, requires_grad=True)
    columns = {}
    for attn in ("eager", "sdpa"):
        model = _build(family, family.base, 1, attn)
        columns[f"HF {attn}"] = (model, None)
    patched = sf.patch(_build(family, family.base, 1, "sdpa"))
    for policy in TARGETS:
        columns[f"slimformer {policy}"] = (patched, policy)
    result = {}
    for name, (model, policy) in columns.items():
        layer = family.layer(model)
        if policy is not None:
            layer.recompute = policy
        with torch.no_grad():
            arguments = family.layer_arguments(model, x)
        torch.manual_seed(0)
        result[name] = _kept(measure_activation_memory(layer, x, *arguments)) / (SEQ * family.hidden)
    return result


def masked_lm_bytes(family: Family) -> dict[str, int]:
    """Column -> bytes one training forward of the whole masked-LM model keeps."""
    eager = _build(family, family.masked_lm, MLM_LAYERS)
    vocab = eager.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (MLM_BATCH, SEQ), generator=generator)
    labels = torch.where(torch.rand(MLM_BATCH, SEQ, generator=generator) < LABELLED, ids, -100)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    models = {"HF eager": eager, "slimformer qkv+mlp": sf.patch(copy.deepcopy(eager), recompute="qkv+mlp")}
    result = {}
    for name, model in models.items():
        torch.manual_seed(0)
        result[name] = _kept(measure_activation_memory(lambda m=model: m(**inputs).loss, exclude=model.parameters()))
    return result


def unpadded_times(family: Family, rounds: int, log=print) -> tuple[dict[str, list[float]], int]:
    """(column -> CPU seconds per training step, real tokens): padded vs unpadded patched."""
    base = _build(family, family.classifier, 2, "sdpa")
    lengths = sentence_lengths()
    mask = (torch.arange(MAX_LEN)[None, :] < torch.tensor(lengths)[:, None]).long()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, base.config.vocab_size, (BATCH, MAX_LEN), generator=generator).masked_fill(mask == 0, 0)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (BATCH,), generator=generator)}
    models = {
        "slimformer padded": sf.patch(copy.deepcopy(base)),
        "slimformer unpadded": sf.patch(copy.deepcopy(base), unpad=True),
    }
    times = {name: [] for name in models}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for model in models.values():  # warm-up
            model(**inputs).loss.backward()
        for round_ in range(rounds):
            for name, model in models.items():
                model.zero_grad(set_to_none=True)
                gc.collect()
                start = time.process_time()
                model(**inputs).loss.backward()
                times[name].append(time.process_time() - start)
            log(f"  round {round_ + 1}/{rounds}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()))
    finally:
        torch.set_num_threads(threads)
    return times, sum(lengths)


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def report(families: list[str], rounds: int, log=print) -> list[str]:
    """The Markdown report (measures everything)."""
    lines = [
        "# The encoder families under sf.patch: kept memory and unpadded speed (CPU)",
        "",
        f"CPU: {device_name(torch.device('cpu'))}; torch {torch.__version__}; fp32, dropout 0.1, "
        "base-size dims, random weights. `python -m bench.families` (see its docstring for the method).",
        "",
        f"## One layer, seq {SEQ}: kept bytes per token per hidden unit",
        "",
        "| family | HF eager | HF sdpa | slimformer none | vs eager | slimformer qkv+mlp | vs eager | targets |",
        "|---|---|---|---|---|---|---|---|",
    ]
    steps = tqdm(total=3 * len(families), desc="bench.families", unit="part")
    results = {}
    for name in families:
        family = FAMILIES[name]
        layer = layer_bytes_per_token(family)
        steps.update()
        mlm = masked_lm_bytes(family)
        steps.update()
        log(f"{name}: unpadded training, {rounds} rounds")
        times, tokens = unpadded_times(family, rounds, log)
        steps.update()
        results[name] = (layer, mlm, times, tokens)
    steps.close()
    for name, (layer, _, _, _) in results.items():
        eager = layer["HF eager"]
        ratios = {policy: layer[f"slimformer {policy}"] / eager for policy in TARGETS}
        ok = all(ratios[policy] <= bound for policy, bound in TARGETS.items())
        lines.append(
            f"| {name} | {eager:.1f} | {layer['HF sdpa']:.1f} | {layer['slimformer none']:.1f} | {ratios['none']:.3f}x"
            f" | {layer['slimformer qkv+mlp']:.1f} | {ratios['qkv+mlp']:.3f}x | none <= {TARGETS['none']}x, "
            f"qkv+mlp <= {TARGETS['qkv+mlp']}x: {_verdict(ok)} |"
        )
    lines += [
        "",
        f"## Whole masked-LM model, {MLM_LAYERS} layers, batch {MLM_BATCH} x {SEQ}: kept bytes of a training forward",
        "",
        "| family | HF eager MiB | slimformer qkv+mlp MiB | vs eager | target |",
        "|---|---|---|---|---|",
    ]
    for name, (_, mlm, _, _) in results.items():
        ratio = mlm["slimformer qkv+mlp"] / mlm["HF eager"]
        lines.append(
            f"| {name} | {mlm['HF eager'] / 2**20:,.1f} | {mlm['slimformer qkv+mlp'] / 2**20:,.1f} | {ratio:.3f}x | "
            f"<= {MLM_TARGET}x: {_verdict(ratio <= MLM_TARGET)} |"
        )
    lines += [
        "",
        f"## Unpadded training, 2 layers, batch {BATCH} padded to {MAX_LEN}",
        "",
        f"One intra-op thread, {rounds} interleaved rounds, process CPU seconds per forward+backward, median "
        "(min–max).",
        "",
        "| family | real tokens | padded s | unpadded s | unpadded tokens/s vs padded | target |",
        "|---|---|---|---|---|---|",
    ]
    for name, (_, _, times, tokens) in results.items():
        padded, unpadded = times["slimformer padded"], times["slimformer unpadded"]
        speedup = statistics.median(padded) / statistics.median(unpadded)
        lines.append(
            f"| {name} | {tokens} of {BATCH * MAX_LEN} | {_spread(padded)} | {_spread(unpadded)} | {speedup:.2f}x | "
            f">= {SPEEDUP}x: {_verdict(speedup >= SPEEDUP)} |"
        )
    return lines


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    families = args.families
    path = Path(args.out) / RESULT_FILE
    refuse_to_replace(parser, [path], args.overwrite)
    text = "\n".join(report(families, args.rounds)) + "\n"
    print(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {shown(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
