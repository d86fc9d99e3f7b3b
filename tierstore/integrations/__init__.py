"""Integrations with serving stacks, one module per stack: ``transformers`` (PrefixCache),
``lmcache`` (TierstoreBackend, a storage plugin), ``vllm`` (TierstoreConnector, a v1 KV
connector); ``paged`` holds the block gather / scatter the vLLM connector uses (torch only).

Each module uses only tierstore's public API and follows its host stack's conventions.  Importing
``tierstore`` never imports this package, and this package imports no stack by itself: a stack's
module imports the stack when it is imported.
"""
