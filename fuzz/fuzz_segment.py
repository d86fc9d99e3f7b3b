"""atheris harness: scanning a segment file (SPEC.md §3, §4.2, §7.3) of arbitrary bytes.

The input becomes the body of a segment (after a valid header, or as the whole file when the
first byte is odd).  The scanner must end with a clean ScanStop -- never another exception,
never a hang -- and every record it yields must lie inside the file.

    python fuzz/fuzz_segment.py /tmp/corpus-segment fuzz/corpus/segment -max_total_time=60
"""

import os
import sys
import tempfile

import atheris
import crc32c  # noqa: F401  (dependencies are imported first, so only tierstore is instrumented)
import lmdb  # noqa: F401
import msgpack  # noqa: F401
import numpy  # noqa: F401

with atheris.instrument_imports():
    from tierstore.engine import segment
    from tierstore.engine.fileio import DEFAULT_IO
    from tierstore.errors import TierstoreError
    from tierstore.format import constants as fmt

HEADER = segment.new_segment_header(b"\0" * 16, 1, 1).encode()
PATH = os.path.join(tempfile.mkdtemp(prefix="fuzz-segment-"), "0000000000000001.tseg")


def test_one_input(data: bytes) -> None:
    body = data if data[:1] and data[0] & 1 else HEADER + data
    with open(PATH, "wb") as f:
        f.write(body)
    fd = os.open(PATH, os.O_RDONLY)
    try:
        try:
            segment.read_segment_header(DEFAULT_IO, fd, path=PATH, seg_id=1)
        except TierstoreError:
            return
        scanner = segment.SegmentScanner(DEFAULT_IO, fd, 1, path=PATH, verify_payload=True)
        for off, hdr in scanner.records():
            assert off >= fmt.SEGMENT_HEADER_SIZE and off + hdr.record_len <= len(body)
        assert scanner.stop is not None and scanner.stop.reason in ("end", "torn", "invalid")
    finally:
        os.close(fd)


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
