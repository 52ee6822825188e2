"""bench.int8_inference's ONNX Runtime rows: the exported model is the torch model."""

import pytest
import torch

from bench import int8_inference
from tests.test_quantize import tiny_bert

pytest.importorskip("onnxruntime")


def _batch(batch: int, seq: int) -> dict:
    gen = torch.Generator().manual_seed(batch * seq)
    ids = torch.randint(1, 100, (batch, seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, seq // 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def test_onnx_runtime_rows_run_the_exported_model_at_any_batch_and_length(tmp_path):
    # the export's sizes (2 x 16) are not baked in, and the inputs reach their own names
    model = tiny_bert()
    fp32, int8 = int8_inference._onnx_runtime_variants(model, tmp_path)
    assert (fp32.name, int8.name) == ("ONNX Runtime fp32", "ONNX Runtime int8")
    assert 0 < int8.size_bytes < fp32.size_bytes
    for batch, seq in [(1, 7), (3, 11), (2, 40)]:
        inputs = _batch(batch, seq)
        with torch.no_grad():
            expected = model(**inputs).last_hidden_state
        real = inputs["attention_mask"].bool()
        torch.testing.assert_close(fp32.model(**inputs).last_hidden_state[real], expected[real], rtol=1e-4, atol=1e-4)
        cosine = torch.nn.functional.cosine_similarity(int8.model(**inputs).last_hidden_state[real], expected[real])
        assert cosine.min() > 0.95
