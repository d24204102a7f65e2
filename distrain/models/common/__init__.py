"""What the decoder families share: the Llama family's attention with RoPE (``attention``), its decoder shell
(embedding, blocks, norm, head; ``decoder``), its config schema (``config``) and its Hugging Face config fields
(``hf``). ``Llama`` and the mixture of experts differ in their blocks only."""
