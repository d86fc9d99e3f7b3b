"""atheris harness: the record decoder (SPEC.md §4) on arbitrary bytes.

Any exception other than CorruptionError is a bug, as is a hang or an allocation that does
not follow from the input's size.  TIERSTORE_FUZZ_NOCRC=1 skips the header checksum so the
fuzzer reaches the checks behind it (a CRC gate stops coverage-guided mutation cold).

    python fuzz/fuzz_record.py /tmp/corpus fuzz/corpus/record -max_total_time=60   # new inputs go to /tmp/corpus
"""

import os
import sys

import atheris
import crc32c  # noqa: F401  (dependencies are imported first, so only tierstore is instrumented)
import lmdb  # noqa: F401
import msgpack  # noqa: F401
import numpy  # noqa: F401

with atheris.instrument_imports():
    from tierstore.errors import CorruptionError
    from tierstore.format import record

VERIFY = os.environ.get("TIERSTORE_FUZZ_NOCRC") != "1"


def test_one_input(data: bytes) -> None:
    try:
        record.decode_header(data, verify=VERIFY)
    except CorruptionError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
