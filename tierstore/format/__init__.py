"""The on-disk format as pure bytes: constants (constants.py), record framing (record.py), extent layout
(layout.py) and typed objects <-> extents (block.py).  No I/O anywhere below this package.

SPEC.md is the authority; each module cites the sections it implements.  The codecs
(``tierstore.codecs``) sit between constants.py and record.py: records validate codec
parameters, codecs know only the constants.
"""
