"""Integrations with serving stacks, one module per stack (``tierstore.integrations.transformers``).

Each module uses only tierstore's public API and follows its host stack's conventions.  Importing
``tierstore`` never imports this package, and this package imports no stack by itself: a stack's
module imports the stack when it is imported.
"""
