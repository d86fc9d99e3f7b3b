"""The cache tiers' options of ``tierstore.open`` (dram_bytes, dram_admit, gpu_bytes, gpu_device, policy):
parsed, checked and defaulted before anything is opened.

It owns the automatic DRAM size (``dram_bytes="auto"``) and reads the machine's memory limit
for it; it allocates nothing and opens no store.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .. import arrays
from ..engine.options import parse_size
from ..errors import InvalidObject
from . import policy as pol

_ZERO = re.compile(r"\s*0+(\.0*)?\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)  # dram_bytes="0", "0GiB": off
DRAM_AUTO_MAX = 1 << 30  # dram_bytes="auto": at most 1 GiB ...
DRAM_AUTO_SHARE = 16  # ... and at most 1/16 of memory (physical, or the cgroup limit)
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1
TIER_OPTIONS = ("dram_bytes", "dram_admit", "gpu_bytes", "gpu_device", "policy")


def memory_limit() -> int:
    """Physical memory, or the container's (cgroup) memory limit when that is lower."""
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        limit = 16 * DRAM_AUTO_MAX
    for path in CGROUP_MEMORY_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < limit:  # "max" (v2) or a huge number: no limit
            limit = int(text)
    return limit


def auto_dram_bytes() -> int:
    """The DRAM tier's size when ``dram_bytes`` is not given."""
    return max(0, min(DRAM_AUTO_MAX, memory_limit() // DRAM_AUTO_SHARE))


def tier_options(options: dict[str, Any]) -> dict[str, Any]:
    """Pop and check the cache tiers' options from ``options``.  ``dram_bytes`` "auto" (the
    default) sizes the DRAM tier from the memory available (``auto_dram_bytes``) and admits on
    the second read; a size given admits on the first; 0 or None: no DRAM tier."""
    dram, gpu = options.pop("dram_bytes", "auto"), options.pop("gpu_bytes", None)
    device, policy = options.pop("gpu_device", None), options.pop("policy", None)
    admit = options.pop("dram_admit", None)
    if admit is not None and admit not in pol.ADMISSIONS:
        raise InvalidObject(f"dram_admit must be one of {', '.join(pol.ADMISSIONS)}, got {admit!r}")
    if dram == "auto":
        dram, admit = auto_dram_bytes() or None, admit or "second"
    elif dram is not None and not (type(dram) is int and dram == 0) and not (isinstance(dram, str)
                                                                           and _ZERO.match(dram)):
        try:
            dram = parse_size(dram, "dram_bytes")
        except InvalidObject as e:  # (0 is allowed here: "must be positive" misled a new user)
            raise InvalidObject(e.message.replace("must be positive", "must be 0 (no DRAM tier) or more"),
                                hint=e.hint) from None
    else:  # 0 (or "0", "0GiB"): no DRAM tier
        dram = None
    admit = admit or "first"
    gpu = parse_size(gpu, "gpu_bytes") if gpu is not None else None
    if device is not None and gpu is None:
        raise InvalidObject("gpu_device= without gpu_bytes= (the GPU tier's size)")
    if gpu is not None:
        device = "cuda:0" if device is None else device
        try:
            arrays.validate_device(device)
        except InvalidObject as e:
            hint = e.hint if "torch" in e.message else 'gpu_device="cpu" runs the GPU tier in CPU memory (tests, CI)'
            raise InvalidObject(f"gpu_device: {e.message}", hint=hint) from None
    return {"dram_bytes": dram, "dram_admit": admit, "gpu_bytes": gpu, "gpu_device": device,
            "policy": pol.make(policy)}
