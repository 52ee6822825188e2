"""The fused masked-LM loss of HuggingFace BERT-family, DistilBERT, ALBERT, MPNet, ModernBERT and DeBERTa-v2
``*ForMaskedLM`` models.

``slimformer.patch`` changes the class of such a model, in place and reversibly, to
``Fused<Model>(FusedMaskedLM, <Model>)``: the same object, Parameters, ``state_dict``
and submodules, with a forward that, in training with ``labels`` (grad enabled,
``return_dict`` not False, ``fused_loss`` True), runs the encoder as before and then
``slimformer.layers.mlm_head.masked_token_loss``: the head's transform on the labelled
positions only and the decoder (tied to the word embeddings, gradients reaching the
shared Parameter) fused with the cross-entropy, so logits over the vocabulary are never
formed. It returns the model's ``MaskedLMOutput`` with ``logits=None`` (as
Liger-Kernel's fused linear cross-entropy does; ``BertForPreTraining``: its output with
``prediction_logits=None``, the next-sentence loss added as HF does, when both
``labels`` and ``next_sentence_label`` are given); the loss is HF's (mean over labelled
tokens, ignore_index -100, NaN when no token is labelled) and so are the gradients.
Every other call (eval, no labels, ``torch.no_grad``, ``return_dict=False``,
``model.fused_loss = False`` to get training logits) runs the model's own forward.
``model.max_labelled_tokens = K`` (an upper bound on a batch's labelled tokens) gathers
K rows for the loss instead of as many as are labelled: no host sync in the step.
Hooks on the head's decoder do not fire on the fused path (the decoder is not called);
hooks on the transform's modules do.
"""

import sys

import torch
import torch.nn.functional as F

from slimformer.integrations.hf.classes import RuntimeMixin
from slimformer.layers.mlm_head import masked_token_loss

# model class -> how its head is laid out: "predictions" (BERT: cls.predictions with
# transform + decoder), "pretraining" (the same, beside cls.seq_relationship for
# next-sentence prediction), "lm_head" (RoBERTa: lm_head with dense, gelu,
# layer_norm, decoder), "distilbert" (the model's own vocab_transform, activation,
# vocab_layer_norm, vocab_projector), "albert" (predictions with dense, activation,
# LayerNorm, decoder: the transform maps hidden to the embedding size), "modernbert" (the
# model's head, a dense-activation-norm module, and decoder) or "deberta" (with
# ``config.legacy`` BERT's cls.predictions, else lm_predictions.lm_head's dense,
# transform_act_fn and LayerNorm, then the word embeddings' weight and the head's bias).
_MASKED_LM_MODELS = {
    ("transformers.models.bert.modeling_bert", "BertForMaskedLM"): "predictions",
    ("transformers.models.bert.modeling_bert", "BertForPreTraining"): "pretraining",
    ("transformers.models.ernie.modeling_ernie", "ErnieForMaskedLM"): "predictions",
    ("transformers.models.roberta.modeling_roberta", "RobertaForMaskedLM"): "lm_head",
    ("transformers.models.xlm_roberta.modeling_xlm_roberta", "XLMRobertaForMaskedLM"): "lm_head",
    ("transformers.models.camembert.modeling_camembert", "CamembertForMaskedLM"): "lm_head",
    ("transformers.models.data2vec.modeling_data2vec_text", "Data2VecTextForMaskedLM"): "lm_head",
    ("transformers.models.distilbert.modeling_distilbert", "DistilBertForMaskedLM"): "distilbert",
    ("transformers.models.albert.modeling_albert", "AlbertForMaskedLM"): "albert",
    ("transformers.models.mpnet.modeling_mpnet", "MPNetForMaskedLM"): "lm_head",
    ("transformers.models.modernbert.modeling_modernbert", "ModernBertForMaskedLM"): "modernbert",
    ("transformers.models.deberta_v2.modeling_deberta_v2", "DebertaV2ForMaskedLM"): "deberta",
}
# The head layouts of BERT-family models (``slimformer.integrations.hf.bert``'s).
BERT_HEADS = frozenset({"predictions", "pretraining", "lm_head"})


def _layout(model: torch.nn.Module) -> str | None:
    model_class = getattr(type(model), "_original_class", type(model))
    return _MASKED_LM_MODELS.get((model_class.__module__, model_class.__name__))


def is_masked_lm(model: torch.nn.Module, heads: frozenset[str]) -> bool:
    """Whether ``model`` is one of the ``*ForMaskedLM`` classes whose loss can be fused,
    with one of the head layouts ``heads`` (a family asks for its own)."""
    return _layout(model) in heads


def _head(model):
    """(transform: (rows, H) -> (rows, E), the decoder: a Linear (V, E), or DeBERTa-v2's word
    embeddings (V, E), whose head adds a bias of its own) of the model's MLM head."""
    layout = _layout(model)
    if layout == "deberta" and not model.legacy:
        head = model.lm_predictions.lm_head

        def transform(rows):
            return head.LayerNorm(head.transform_act_fn(head.dense(rows)))

        return transform, model.deberta.embeddings.word_embeddings
    if layout == "distilbert":

        def transform(rows):
            return model.vocab_layer_norm(model.activation(model.vocab_transform(rows)))

        return transform, model.vocab_projector
    if layout == "modernbert":
        return model.head, model.decoder
    if layout == "albert":
        head = model.predictions

        def transform(rows):
            return head.LayerNorm(head.activation(head.dense(rows)))

        return transform, head.decoder
    head = model.lm_head if layout == "lm_head" else model.cls.predictions  # BERT's, DeBERTa-v2's legacy
    if layout != "lm_head":
        return head.transform, head.decoder
    gelu = sys.modules[type(head).__module__].gelu  # the function the head's own forward calls

    def transform(rows):
        return head.layer_norm(gelu(head.dense(rows)))

    return transform, head.decoder


def _decoder_weight_and_bias(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    decoder = _head(model)[1]
    if type(decoder) is torch.nn.Embedding:  # DeBERTa-v2's lm_predictions
        return decoder.weight, model.lm_predictions.lm_head.bias
    return decoder.weight, decoder.bias


def masked_lm_problem(model: torch.nn.Module) -> str | None:
    """Why the MLM loss of ``model`` (an allow-listed class) cannot be fused, or None."""
    decoder = _head(model)[1]
    expected = torch.nn.Embedding if _layout(model) == "deberta" and not model.legacy else torch.nn.Linear
    if type(decoder) is not expected:
        return f"the head's decoder is a {type(decoder).__name__}, not torch.nn.{expected.__name__}"
    return None


class FusedMaskedLM(RuntimeMixin):
    """Forward of a patched ``*ForMaskedLM`` model, mixed before the model's own class
    (see the module docstring); it takes the model's own arguments, and
    ``inspect.signature`` of it is the model's (transformers' Trainer keeps the dataset
    columns it names). ``fused_loss`` (default True) switches the fused loss off;
    ``max_labelled_tokens`` (default None) set to an upper bound on a batch's labelled
    tokens makes the loss gather that many rows, with no host sync
    (``masked_token_loss``'s fixed-shape path)."""

    fused_loss = True
    max_labelled_tokens = None

    def forward(self, *args, **kwargs):
        bound = self._forward_signature.bind(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        labels = arguments.pop("labels", None)
        next_sentence_label = arguments.pop("next_sentence_label", None)
        extra = arguments.pop("kwargs", {})
        return_dict = extra.pop("return_dict", None)
        if return_dict is None:
            return_dict = self.config.return_dict
        pretraining = _layout(self) == "pretraining"
        # BertForPreTraining computes a loss only when both label tensors are given
        has_loss = labels is not None and (next_sentence_label is not None or not pretraining)
        if not (has_loss and self.training and torch.is_grad_enabled() and self.fused_loss and return_dict):
            return super().forward(*args, **kwargs)
        arguments.pop("self")
        outputs = getattr(self, self.base_model_prefix)(**arguments, **extra, return_dict=True)
        transform = _head(self)[0]
        loss = masked_token_loss(
            outputs[0],
            labels,
            transform,
            *_decoder_weight_and_bias(self),
            max_labelled_tokens=self.max_labelled_tokens,
        )
        common = dict(hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        if not pretraining:
            return self._output_class(loss=loss, logits=None, **common)
        scores = self.cls.seq_relationship(outputs[1])
        loss = loss + F.cross_entropy(scores.view(-1, 2), next_sentence_label.view(-1))
        return self._output_class(loss=loss, prediction_logits=None, seq_relationship_logits=scores, **common)

    @classmethod
    def class_attributes(cls, model_class: type) -> dict:
        return {"_output_class": _output_class(model_class)}


def _output_class(model_class: type) -> type:
    """What the model's forward returns: ``MaskedLMOutput``, or ``BertForPreTrainingOutput``."""
    if _MASKED_LM_MODELS[model_class.__module__, model_class.__name__] == "pretraining":
        return getattr(sys.modules[model_class.__module__], f"{model_class.__name__}Output")
    from transformers.modeling_outputs import MaskedLMOutput

    return MaskedLMOutput
