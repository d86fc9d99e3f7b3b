"""atheris harness: the metadata decoder and schema (SPEC.md §5) on arbitrary bytes.

msgpack bytes are decoded with the format's limits (depth, sizes, no ext types), then checked
against every kind's schema with exact arithmetic.  Only CorruptionError may escape.

    python fuzz/fuzz_meta.py /tmp/corpus-meta fuzz/corpus/meta -max_total_time=60
"""

import sys

import atheris
import crc32c  # noqa: F401  (dependencies are imported first, so only tierstore is instrumented)
import lmdb  # noqa: F401
import msgpack  # noqa: F401
import numpy  # noqa: F401

with atheris.instrument_imports():
    from tierstore.errors import CorruptionError
    from tierstore.format import constants as fmt
    from tierstore.format import record


def test_one_input(data: bytes) -> None:
    try:
        meta = record.unpack_meta(data)
    except CorruptionError:
        return
    for kind in (fmt.KIND_KV, fmt.KIND_VECTORS, fmt.KIND_BLOB, 0, 99):
        try:
            lengths = record.expected_extent_lengths(kind, meta)
        except CorruptionError:
            continue
        assert all(0 <= n < 2**63 for n in lengths) and len(lengths) <= fmt.MAX_EXTENTS


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
