"""Activation memory of masked-LM training: HF ``BertForMaskedLM`` eager vs patched.

BERT-base dimensions with 2 layers, batch 4, seq 512, 15% of the tokens labelled,
dropout 0.1, fp32, training mode; ``slimformer.memory.measure_activation_memory``
(the larger of what autograd saves and what stays allocated) of the whole model called
with labels, and of ``model.bert`` alone. The slimformer columns run the PyTorch
reference path on CPU (the same tensors are saved as on the kernel path).

    python -m bench.mlm_memory [--layers 2] [--batch 4] [--seq 512]
"""

import argparse
import copy

import torch

import slimformer as sf
from slimformer.memory import format_bytes, measure_activation_memory


def _kept(memory) -> int:
    return max(memory.saved_bytes, memory.alive_bytes)


def _inputs(vocab: int, batch: int, seq: int, fraction: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (batch, seq), generator=generator)
    labelled = torch.rand(batch, seq, generator=generator) < fraction
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.where(labelled, ids, -100)}


def main(argv=None) -> None:
    from transformers import BertConfig, BertForMaskedLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--masked", type=float, default=0.15)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=args.layers, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    eager = BertForMaskedLM(config).train()
    eager.set_attn_implementation("eager")
    patched = sf.patch(copy.deepcopy(eager))
    inputs = _inputs(config.vocab_size, args.batch, args.seq, args.masked)
    encoder_inputs = {k: v for k, v in inputs.items() if k != "labels"}
    columns = {
        "HF eager": (eager, None), "slimformer none": (patched, "none"), "slimformer qkv+mlp": (patched, "qkv+mlp"),
    }  # fmt: skip
    print(f"BertForMaskedLM, BERT-base dims, {args.layers} layers, batch {args.batch}, seq {args.seq}, "
          f"{args.masked:.0%} labelled, dropout 0.1, fp32, CPU")  # fmt: skip
    print(f"{'':<20} {'whole model':>12} {'model.bert':>12} {'head + loss':>12}")
    for name, (model, policy) in columns.items():
        if policy is not None:
            sf.recompute(model, policy)
        whole = _kept(measure_activation_memory(model, **inputs))
        encoder = _kept(measure_activation_memory(model.bert, **encoder_inputs))
        print(f"{name:<20} {format_bytes(whole):>12} {format_bytes(encoder):>12} {format_bytes(whole - encoder):>12}")


if __name__ == "__main__":
    main()
