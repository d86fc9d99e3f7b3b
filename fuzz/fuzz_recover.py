"""atheris harness: recovery (index rebuild and open) over a mutated segment file.

A small valid store is written once; each input replaces the bytes of its segment after the
header (so the fuzzer works on records, not on the header's checksum).  Opening the store
rebuilds the index from the mutated log; every object it then reports must read back or
raise CorruptionError.  Any other exception, crash or hang is a bug.

    python fuzz/fuzz_recover.py /tmp/corpus-recover fuzz/corpus/recover -max_total_time=60
"""

import os
import shutil
import sys
import tempfile

import atheris
import crc32c  # noqa: F401  (dependencies are imported first, so only tierstore is instrumented)
import lmdb  # noqa: F401
import msgpack  # noqa: F401
import numpy  # noqa: F401

with atheris.instrument_imports():
    import tierstore
    from tierstore.errors import CorruptionError, TierstoreError

BASE = tempfile.mkdtemp(prefix="fuzz-recover-")
WORK = os.path.join(BASE, "work")


def test_one_input(data: bytes) -> None:
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(os.path.join(WORK, "segments"))
    seg = os.path.join(WORK, "segments", "0000000000000001.tseg")
    with open(seg, "wb") as f:
        f.write(HEADER + data)
    try:
        store = tierstore.open(WORK, lock_timeout=1)
    except TierstoreError:
        return
    try:
        for ns in store.namespaces():
            for key in store.keys(namespace=ns):
                try:
                    store.get(key, namespace=ns, device=None)
                except CorruptionError:
                    pass
        store.put("after", tierstore.Blob(b"x"))  # the recovered log accepts appends
        assert store.get("after").data == b"x"
    finally:
        store.close()


def _seed_header() -> bytes:
    seed = os.path.join(BASE, "seed")
    with tierstore.open(seed) as s:
        s.put("k", tierstore.Blob(b"v"))
    path = os.path.join(seed, "segments", "0000000000000001.tseg")
    with open(path, "rb") as f:
        return f.read(4096)


HEADER = _seed_header()

if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
