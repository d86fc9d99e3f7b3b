"""atheris harness: the independent reader (format/reference_reader.py) on a mutated segment.

Only reference_reader.FormatError (or a clean result) may come out; UnicodeDecodeError from
a namespace that is not UTF-8 is a FormatError in spirit and is accepted.

    python fuzz/fuzz_reader.py /tmp/corpus-reader fuzz/corpus/segment -max_total_time=60
"""

import importlib.util
import os
import sys
import tempfile

import atheris
import crc32c  # noqa: F401  (dependencies are imported first, so only tierstore is instrumented)
import lmdb  # noqa: F401
import msgpack  # noqa: F401
import numpy  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("reference_reader", os.path.join(HERE, "..", "format",
                                                                               "reference_reader.py"))
reader = importlib.util.module_from_spec(spec)
sys.modules["reference_reader"] = reader
with atheris.instrument_imports():
    spec.loader.exec_module(reader)
    from tierstore import segment

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
