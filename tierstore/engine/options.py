"""Options of ``tierstore.open``: sizes parsed, every knob checked, before anything is opened.

Pure: parsing and checking only; it opens, creates and allocates nothing.  The engine reads
the log and index knobs, the handle the rest (``vector_extent_bytes``); the cache tiers'
options are the tiers' own (tiers/config.py).
"""

from __future__ import annotations

import difflib
import fractions
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidObject
from ..format import constants as fmt
from .segment import DIRECT_READS

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(value: int | str, name: str = "size") -> int:
    """Bytes from an int or a string like "16GiB", "512MB", "4096": KiB/MiB/GiB/TiB and the
    bare K/M/G/T are powers of 1024, KB/MB/GB/TB powers of 1000 (as in "512MB" of a disk)."""
    if isinstance(value, bool):
        raise InvalidObject(f"{name} must be a size, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        unit = (m.group(2) or "B").upper()
        base = 1024 if "I" in unit or unit in ("K", "M", "G", "T") else 1000
        power = "BKMGT".index(unit[0]) if unit != "B" else 0
        exact = fractions.Fraction(m.group(1)) * base**power
        if power == 0 and exact.denominator != 1:  # (in KiB and up a fraction rounds down to whole bytes)
            raise InvalidObject(f"{name} must be a whole number of bytes, got {value!r}",
                                hint="give bytes as an integer, or a unit: '512KiB', '1.5GiB'")
        n = int(exact)
    else:
        raise InvalidObject(f"{name} must be an int or a size string like '16GiB', got {value!r}")
    if n <= 0:
        raise InvalidObject(f"{name} must be positive, got {value!r}")
    return n


@dataclass(frozen=True)
class Options:
    """Tuning knobs of ``tierstore.open`` (all optional).  Sizes take ints or "64MiB" strings."""

    segment_bytes: int = 1 << 30  # roll over to a new segment past this size
    group_commit_ms: float = 10.0  # durability="group": sync at most this long after a put
    group_commit_bytes: int = 64 << 20  # durability="group": or once this much is unsynced
    index_commit_ms: float = 50.0  # apply the index at most this long after a durable record
    index_batch: int = 1024  # or once this many records are waiting
    lock_timeout: float = 60.0  # seconds to wait for another writer to close
    vector_extent_bytes: int = 64 << 10  # target extent size of a vector row range
    index_map_size: int = 32 << 30  # LMDB map reserved (address space, not disk; it doubles when full)
    direct_reads: str = "auto"  # cold, page-aligned reads via O_DIRECT: "auto" (8 MiB and more), "always", "never"
    reserve_bytes: int | None = None  # disk space held back for deletes and compact() on a full disk (None: auto)
    # hold the store alone for the handle's life (SPEC.md §7.2): other writer processes wait and fail
    # with StoreLocked, appends skip the cross-process append lock (§7.8), small puts run faster
    exclusive: bool = False
    # format 1.5's HEADERS records (SPEC.md §4.5): a copy of each record header, so that a damaged header in a
    # sealed segment costs nothing even without the index.  False: not written (tiny objects: up to half the
    # log bytes; such a damaged header then needs the index, as before 1.5: without it, recover drops the object)
    header_copies: bool = True

    def engine_settings(self) -> dict[str, Any]:
        """The settings the log and the index run with (what handles sharing an engine must agree on)."""
        return {k: getattr(self, k) for k in ("segment_bytes", "group_commit_ms", "group_commit_bytes",
                                              "index_commit_ms", "index_batch", "index_map_size", "direct_reads",
                                              "exclusive", "header_copies")}

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], *, also: Sequence[str] = ()) -> "Options":
        """Parse ``kwargs`` (the options of ``open`` left over once ``also``, the options other
        layers took, were popped); an unknown one names every option there is."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            everything = sorted(known | set(also))
            near = {u: difflib.get_close_matches(u, everything, n=1) for u in unknown}
            guess = "; ".join(f"{u}: did you mean {m[0]}?" for u, m in near.items() if m)
            raise InvalidObject(f"unknown option(s) {', '.join(unknown)}" + (f" ({guess})" if guess else "")
                                + f"; known: {', '.join(everything)}")
        vals: dict[str, Any] = {}
        for k, v in kwargs.items():
            if k == "reserve_bytes" and (v is None or (type(v) is int and v == 0)):
                vals[k] = 0 if v is not None else None
            elif k.endswith("_bytes") or k == "index_map_size":
                vals[k] = parse_size(v, k)
            elif k == "direct_reads":
                if not isinstance(v, str) or v not in DIRECT_READS:
                    raise InvalidObject(f"{k} must be one of {', '.join(DIRECT_READS)}, got {v!r}")
                vals[k] = v
            elif k in ("exclusive", "header_copies"):
                if not isinstance(v, bool):
                    raise InvalidObject(f"{k} must be True or False, got {v!r}")
                vals[k] = v
            elif k in ("index_batch",):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise InvalidObject(f"{k} must be a positive int, got {v!r}")
                vals[k] = v
            else:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                    raise InvalidObject(f"{k} must be a non-negative number, got {v!r}")
                vals[k] = float(v)
        if vals.get("segment_bytes", cls.segment_bytes) < 2 * fmt.PAGE:
            raise InvalidObject("segment_bytes must be at least 8 KiB")
        return cls(**vals)
