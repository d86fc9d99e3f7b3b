"""atheris harness: every codec decoder (SPEC.md §6) on arbitrary extent bytes.

The first bytes choose the codec, the extent's shape and dtype, and the parameters; the rest
is the stored extent.  Decoding must return exactly the extent's logical bytes or raise
CorruptionError, whatever the input, and never allocate more than a bound derived from the
shape (a zstd frame claiming more is refused before decompressing).

    python fuzz/fuzz_codec.py /tmp/corpus-codec fuzz/corpus/codec -max_total_time=60
"""

import sys

import atheris
import crc32c  # noqa: F401  (dependencies are imported first, so only tierstore is instrumented)
import lmdb  # noqa: F401
import msgpack  # noqa: F401
import numpy  # noqa: F401
import zstandard  # noqa: F401

with atheris.instrument_imports():
    from tierstore import codecs
    from tierstore.errors import CorruptionError

IDS = sorted(codecs.BY_ID)
DTYPES = ["float16", "bfloat16", "float32", "float64"]


def extent_for(codec: codecs.Codec, a: int, b: int, c: int, d: int) -> codecs.Extent:
    kind = codec.kinds[a % len(codec.kinds)]
    dtype = DTYPES[d % 4] if not codec.lossless or kind != "blob" else None
    if kind == "kv":
        return codecs.Extent("kv", (2, 1 + b % 3, 1 + c % 40, 1 + d % 40), dtype)
    if kind == "vectors":
        return codecs.Extent("vectors", (1 + b % 30, 1 + c % 50), dtype)
    return codecs.Extent("blob", (b * 256 + c,), None)


def test_one_input(data: bytes) -> None:
    if len(data) < 6:
        return
    codec = codecs.BY_ID[IDS[data[0] % len(IDS)]]
    ext = extent_for(codec, data[1], data[2], data[3], data[4])
    params = dict(codec.defaults)
    flags = data[5]
    if "group" in params:
        params["group"] = 1 + flags % 64
    if flags & 0x80 and codec.id in codecs.POST_ZSTD:
        params["zstd"] = 1
    try:
        out = codecs.decode(codec, data[6:], ext, params)
    except CorruptionError:
        return
    assert out.nbytes == ext.nbytes, (codec.name, ext, out.nbytes)


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
