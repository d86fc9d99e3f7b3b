"""The cache tiers over the log: DRAM and GPU tiers (tier.py), their eviction policies (policy.py),
device I/O (devio.py) and the read path through them (hierarchy.py).

Tiers hold copies; the log stays the durable home of every object.  Nothing here writes a
record or imports the handle: the hierarchy is given the engine's read interface.
"""
