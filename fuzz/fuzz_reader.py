"""atheris harness: the independent reader (format/reference_reader.py) on a mutated segment.

Only reference_reader.FormatError (or a clean result) may come out; UnicodeDecodeError from
a namespace that is not UTF-8 is a FormatError in spirit and is accepted.

    python fuzz/fuzz_reader.py /tmp/corpus-reader fuzz/corpus/segment -max_total_time=60
"""

import os
import sys
import tempfile

import atheris
import crc32c  # noqa: F401  (dependencies are imported first, so only tierstore is instrumented)
import lmdb  # noqa: F401
import msgpack  # noqa: F401
import numpy  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "format"))
# a plain import, so that atheris's import hook instruments the reader (a module executed
# through importlib.util.spec_from_file_location is not instrumented: no coverage feedback)
with atheris.instrument_imports():
    import reference_reader as reader

    from tierstore.engine import segment

HEADER = segment.new_segment_header(b"\0" * 16, 1, 1).encode()
STORE = tempfile.mkdtemp(prefix="fuzz-reader-")
os.makedirs(os.path.join(STORE, "segments"))
PATH = os.path.join(STORE, "segments", "0000000000000001.tseg")


def test_one_input(data: bytes) -> None:
    with open(PATH, "wb") as f:
        f.write(data if data[:1] and data[0] & 1 else HEADER + data)
    try:
        reader.describe(STORE)
    except (reader.FormatError, UnicodeDecodeError):
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
