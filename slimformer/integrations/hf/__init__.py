"""HuggingFace transformers (>= 5) integrations, one module per model family or concern.

- ``bert``: BERT-family encoder layers (``FusedBertFamilyLayer``) and embeddings, and
  the family's entry in ``slimformer.patch``'s registry;
- ``distilbert``, ``albert``, ``mpnet``, ``modernbert``, ``deberta``: the other encoder
  families' layers (DeBERTa-v2/-v3: the disentangled attention in one kernel);
- ``llama``: HF RMSNorms whose forward is LlamaRMSNorm's (``FusedLlamaStyleRMSNorm``);
- ``masked_lm``: the fused masked-LM loss of BERT-family ``*ForMaskedLM`` models;
- ``unpad``: unpadded BERT-family base models, and the packing of a padded batch;
- ``attention``: slimformer's attention as transformers' attention implementation
  "slimformer" (``register_transformers_attention``);
- ``quantizer``: slimformer's quantization as transformers' quantization method
  "slimformer" (``SlimformerInt8Config``; importing it imports transformers);
- ``classes``: the classes made at run time over a transformers class.

Importing this package imports none of them, and none imports transformers at module
level but ``quantizer``.
"""
