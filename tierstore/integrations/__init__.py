"""Integrations with serving stacks, one module per stack: ``transformers`` (PrefixCache),
``lmcache`` (TierstoreBackend, a storage plugin), ``vllm`` (TierstoreConnector, a v1 KV
connector); ``paged`` holds the block gather / scatter the vLLM connector uses (torch only).

Each module uses only tierstore's public API and follows its host stack's conventions.  Importing
``tierstore`` never imports this package, and this package imports no stack by itself: a stack's
module imports the stack when it is imported.
"""

# configuration fields that do not change the KV a model computes (names, paths, generation
# defaults): left out of the model fingerprints that salt chunk keys (SPEC.md §13.1)
CONFIG_NOT_KV = frozenset({
    "_name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "bos_token_id",
    "eos_token_id", "pad_token_id", "tie_word_embeddings", "_attn_implementation", "_attn_implementation_autoset",
    "attn_implementation", "problem_type", "tokenizer_class"})
