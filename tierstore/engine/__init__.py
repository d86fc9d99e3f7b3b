"""The engine: segment files, the log, the LMDB index and the commit protocol between them; recovery, compaction.

It knows records, never objects: what a key's bytes mean is the format's and the handle's
business.  Nothing here imports the tiers, the handle, the CLI or the benchmarks; they are
given an ``Engine`` (engine.py) or a narrower part of it.
"""
