"""Writes tests/data/models-before-architecture.pt: patched and quantized models pickled whole.

Run once at commit 16f0265, the last before the architecture change of issue 25
(``python tests/data/save_models.py``); tests/test_saved_models.py loads the file with
the current code, so models users saved with ``torch.save`` keep loading after modules
move. The inputs and the outputs at save time are stored beside the models.
"""

from pathlib import Path

import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

import slimformer as sf

TINY = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 100,
    "max_position_embeddings": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
}  # fmt: skip
FILE = Path(__file__).with_name("models-before-architecture.pt")


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    config = BertConfig(**TINY)
    encoder_layer = nn.TransformerEncoderLayer(32, 4, 64, 0.0, "gelu", batch_first=True)
    llama = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=100
    )
    return {
        "patched_mlm_qkv+mlp": sf.patch(BertForMaskedLM(config), recompute="qkv+mlp"),
        "unpadded_classifier": sf.patch(BertForSequenceClassification(config), unpad=True),
        "quantized_classifier": sf.quantize(BertForSequenceClassification(config), mode="int8"),
        "patched_then_quantized_classifier": sf.quantize(
            sf.patch(BertForSequenceClassification(config)), mode="int8", skip=("classifier", "pooler")
        ),
        "patched_torch_encoder": sf.patch(nn.TransformerEncoder(encoder_layer, 2, enable_nested_tensor=False)),
        "patched_llama": sf.patch(LlamaForCausalLM(llama)),
    }


def _inputs(name: str):
    generator = torch.Generator().manual_seed(1)
    if name == "patched_torch_encoder":
        return {"src": torch.randn(2, 9, 32, generator=generator)}
    ids = torch.randint(0, 100, (2, 9), generator=generator)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def first_output(output) -> torch.Tensor:
    """The logits or hidden states a model returned, whatever it returned them in."""
    return output if isinstance(output, torch.Tensor) else output[0]


def main() -> None:
    saved = {}
    for name, model in _models().items():
        model.eval()
        inputs = _inputs(name)
        with torch.no_grad():
            saved[name] = {"model": model, "inputs": inputs, "output": first_output(model(**inputs))}
    torch.save(saved, FILE)
    print(f"wrote {FILE} ({FILE.stat().st_size / 2**10:.0f} KiB)")


if __name__ == "__main__":
    main()
