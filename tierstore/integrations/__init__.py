"""Integrations with serving stacks, one module per stack: ``transformers`` (PrefixCache),
``lmcache`` (TierstoreBackend, a storage plugin), ``vllm`` (TierstoreConnector, a v1 KV
connector); ``paged`` holds the block gather / scatter the vLLM connector uses (torch only).

Each module uses only tierstore's public API and follows its host stack's conventions.  Importing
``tierstore`` never imports this package, and this package imports no stack by itself: a stack's
module imports the stack when it is imported.
"""

import json
import re

# configuration fields that do not change the KV a model computes (names, paths, generation
# defaults): left out of the model fingerprints that salt chunk keys (SPEC.md §13.1)
CONFIG_NOT_KV = frozenset({
    "_name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "bos_token_id",
    "eos_token_id", "pad_token_id", "tie_word_embeddings", "_attn_implementation", "_attn_implementation_autoset",
    "attn_implementation", "problem_type", "tokenizer_class"})


def stable_json(value: object) -> str:
    """``value`` as sorted JSON that is the same in every process (a fingerprint's part): a set
    as a sorted list, a function or class by its module and name, any other value JSON cannot
    encode as its ``str`` less any memory address (`` at 0x...``: it would differ between
    processes, and a scheduler's keys would never match its workers')."""
    def text(v: object) -> object:
        if isinstance(v, (set, frozenset)):
            return sorted(v, key=repr)
        if callable(v) and hasattr(v, "__qualname__"):
            return f"{getattr(v, '__module__', '')}.{v.__qualname__}"
        return re.sub(r" at 0x[0-9a-fA-F]+", "", str(v))

    return json.dumps(value, sort_keys=True, default=text)


def config_json(config: dict) -> str:
    """A model configuration as the fingerprints hash it (SPEC.md §13.1): ``stable_json`` of
    it, the fields that do not change the KV left out."""
    return stable_json({k: v for k, v in config.items() if k not in CONFIG_NOT_KV})
