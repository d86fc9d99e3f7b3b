"""Quantiser arithmetic shared by the lossy codecs (SPEC.md §6.3-6.5): scales rounded so that values never
leave their range, symmetric and asymmetric (KIVI) codes, bit packing, fp8 e4m3, and the assembly of
parsed parts (codes and scales) back into values with numpy or with torch on a device.

Pure functions over arrays: no I/O, no codec ids, nothing about records.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CorruptionError


def f16_up(s: np.ndarray) -> np.ndarray:
    """float32 -> the smallest float16 >= it (so that scaled values never exceed their range)."""
    h = s.astype(np.float16)
    low = h.astype(np.float32) < s
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


VALUE_MAX = np.float32(65504)  # a code never decodes past this (float16's largest; see below)


def code_limit(s: np.ndarray, m: int) -> np.ndarray:
    """Per scale ``s`` (float32), the largest code q <= m with q * s <= VALUE_MAX in binary32, as
    the decoder computes it: scales are rounded up, so m * s can pass float16's largest value
    (a value of 65504 came back as inf, or, past 66000, as a damaged extent)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s > 0, np.minimum(np.float32(m), np.floor(VALUE_MAX / s)), np.float32(m))
    q = q.astype(np.float32)
    q[q * s > VALUE_MAX] -= 1  # (the division may round up)
    return q


def absmax_int8(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 over ``axis``: float16 scales (absmax / 127, rounded up) and codes (within
    ``code_limit``)."""
    s = f16_up(np.abs(x).max(axis=axis, keepdims=True) / np.float32(127))
    sf = s.astype(np.float32)
    q = np.rint(np.divide(x, sf, out=np.zeros_like(x), where=sf > 0))
    lim = code_limit(sf, 127)
    return s, np.clip(q, -lim, lim).astype(np.int8)


LOG_SCALE_BIAS = 180  # one-byte scales: s = 2^((c - 180) / 8), c in 0..255 (SPEC.md §6.3)


def log_scale(c: np.ndarray, m: int = 127) -> np.ndarray:
    """The binary32 nearest to 2^((c - 180) / 8) * 127 / m (computed in binary64, then rounded):
    with codes in [-m, m] the largest magnitude is 127 * 2^((c - 180) / 8) whatever m is."""
    return (np.exp2((c.astype(np.float64) - LOG_SCALE_BIAS) / 8) * (127 / m)).astype(np.float32)


def log_int8(x: np.ndarray, axis: int, m: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric quantisation to [-m, m] over ``axis`` with one-byte log-scale codes: the
    smallest c with m * s(c) >= absmax, s(c) = 2^((c-180)/8) * 127 / m (absmax 0: c = 0)."""
    c, s, a = log_scales(x, axis, m)
    q = np.rint(np.divide(x, s, out=np.zeros_like(x), where=a > 0))
    lim = code_limit(s, m)
    return c, np.clip(q, -lim, lim).astype(np.int8 if m <= 127 else np.int16)


def log_scales(x: np.ndarray, axis: int, m: int = 127) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``log_int8``'s scales: the one-byte codes c, the float32 scales s(c) and the absmax a
    over ``axis`` (keepdims); a value's code is rint(x / s) clipped to +-``code_limit(s, m)``
    (m but near float16's largest value), 0 where a = 0."""
    a = np.abs(x).max(axis=axis, keepdims=True)
    with np.errstate(divide="ignore"):
        c = np.ceil(np.log2(a / np.float32(127)) * 8) + LOG_SCALE_BIAS
    c = np.where(a > 0, np.clip(c, 0, 255), 0).astype(np.uint8)
    low = (log_scale(c, m) * m < a) & (c < 255)  # float rounding at a code boundary: one code up
    c[low] += 1
    s = log_scale(c, m)
    # near float16's largest value, m * s(c) can pass it (s grows by 2^(1/8) a code): codes are
    # then held to ``code_limit``, or the scale goes one code down (values past m * s(c - 1)
    # clipped there), whichever decodes the token's largest value closer (few levels: a lower
    # scale; many: one code less)
    over = (s * np.float32(m) > VALUE_MAX) & (c > 0)
    if over.any():
        down = log_scale(c - 1, m)
        kept = np.abs(a - code_limit(s, m) * s)
        lowered = np.abs(a - np.minimum(np.float32(m), code_limit(down, m)) * down)
        c[over & (lowered < kept)] -= 1
        s = log_scale(c, m)
    return c, s, a


def groups(n: int, g: int) -> int:
    return -(-n // g)


def minmax_codes(x: np.ndarray, bits: int, group: int, axis: int,
                  levels: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric quantisation in groups of ``group`` along ``axis`` (KIVI): per group a float16
    minimum (rounded down) and step (rounded up), codes in [0, levels] (levels = 2^bits - 1):
    rint((x - lo) / step) clipped, 0 where the step is 0."""
    levels = (1 << bits) - 1 if levels is None else levels
    n = x.shape[axis]
    xg, lo, step = _minmax_groups(x, group, axis, levels)
    lo_f, step_f = lo.astype(np.float32)[..., None], step.astype(np.float32)[..., None]
    q = np.rint(np.divide(xg - lo_f, step_f, out=np.zeros_like(xg), where=step_f > 0))
    q = np.clip(q, 0, levels).astype(np.uint8)  # (the step keeps lo + levels * step <= VALUE_MAX)
    q = q.reshape(*xg.shape[:-2], -1)[..., :n]
    return lo, step, np.moveaxis(q, -1, axis)


def minmax_scales(x: np.ndarray, group: int, axis: int, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """``minmax_codes``'s float16 minima and steps alone (shaped as it returns them)."""
    _, lo, step = _minmax_groups(x, group, axis, levels)
    return lo, step


def _minmax_groups(x: np.ndarray, group: int, axis: int, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x`` with ``axis`` moved last and cut in groups (the last one padded), and each group's
    float16 minimum (rounded down) and step (rounded up)."""
    n = x.shape[axis]
    pad = groups(n, group) * group - n
    xm = np.moveaxis(x, axis, -1)
    if pad:  # pad with the group's own values (edge), so min/max are those of the real elements
        xm = np.concatenate([xm, np.repeat(xm[..., -1:], pad, axis=-1)], axis=-1)
    xg = xm.reshape(*xm.shape[:-1], -1, group)
    lo = xg.min(axis=-1).astype(np.float16)
    lo_f = lo.astype(np.float32)
    too_high = lo_f > xg.min(axis=-1)
    lo[too_high] = np.nextafter(lo[too_high], np.float16(-np.inf))
    lo_f = lo.astype(np.float32)
    step = f16_up((xg.max(axis=-1) - lo_f) / np.float32(levels))
    # near float16's largest value the rounded-up step can carry the top code past it: the step
    # is then the largest float16 whose top code stays within (at most one float16 unit below
    # the exact step: a top value moves by `levels` such units, not by a step)
    over = lo_f + np.float32(levels) * step.astype(np.float32) > VALUE_MAX
    if over.any():
        fit = ((VALUE_MAX - lo_f[over]) / np.float32(levels)).astype(np.float16)
        high = lo_f[over] + np.float32(levels) * fit.astype(np.float32) > VALUE_MAX
        fit[high] = np.nextafter(fit[high], np.float16(0))
        step[over] = fit
    return xg, lo, step


def minmax_decode(lo: np.ndarray, step: np.ndarray, q: np.ndarray, group: int, axis: int) -> np.ndarray:
    n = q.shape[axis]
    qm = np.moveaxis(q, axis, -1).astype(np.float32)
    idx = np.arange(n) // group
    out = lo.astype(np.float32)[..., idx] + qm * step.astype(np.float32)[..., idx]
    return np.moveaxis(out, -1, axis)


def pack(codes: np.ndarray, bits: int) -> bytes:
    """Codes (uint8 < 2^bits) in C order, packed little-end first: element i in bits
    [(i % per) * bits, ...) of byte i // per (per = 8 / bits)."""
    per = 8 // bits
    c = codes.reshape(-1)
    pad = (-len(c)) % per
    if pad:
        c = np.concatenate([c, np.zeros(pad, np.uint8)])
    c = c.reshape(-1, per).astype(np.uint8)
    out = np.zeros(len(c), np.uint8)
    for j in range(per):
        out |= c[:, j] << np.uint8(j * bits)
    return out.tobytes()


def unpack(b: np.ndarray, bits: int, n: int) -> np.ndarray:
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    out = np.empty((len(b), per), np.uint8)
    for j in range(per):
        out[:, j] = (b >> np.uint8(j * bits)) & mask
    return out.reshape(-1)[:n]


# fp8 e4m3fn (OCP): bias 7, 3 mantissa bits, max 448, no infinities
E4M3 = np.array([((-1) ** (i >> 7)) * (((i & 7) / 8) * 2.0 ** -6 if (i >> 3) & 15 == 0
                                         else (1 + (i & 7) / 8) * 2.0 ** (((i >> 3) & 15) - 7))
                  for i in range(256)], dtype=np.float32)
E4M3[[0x7F, 0xFF]] = np.nan


def to_e4m3(y: np.ndarray) -> np.ndarray:
    """float32 in [-448, 448] -> e4m3fn bytes, round to nearest even."""
    a = np.abs(y)
    _, k = np.frexp(np.maximum(a, np.float32(2.0 ** -6)))
    step = np.ldexp(np.float32(1), (k - 1 - 3).astype(np.int32))  # ulp of the binade (subnormals: 2^-9)
    q = np.minimum(np.rint(a / step) * step, np.float32(448))
    m, k2 = np.frexp(q)  # q = m * 2^k2, m in [0.5, 1)
    normal = q >= np.float32(2.0 ** -6)
    e_field = np.where(normal, k2 - 1 + 7, 0)
    mant = np.where(normal, np.rint((m * 2 - 1) * 8), np.rint(q / np.float32(2.0 ** -9)))
    bits = (e_field.astype(np.uint8) << 3) | mant.astype(np.uint8)
    return bits | (np.signbit(y) & (q > 0)).astype(np.uint8) << 7


def e4m3_within(bits: np.ndarray, s: np.ndarray) -> np.ndarray:
    """e4m3 codes whose value times the scale ``s`` (binary32, as decoded) passes VALUE_MAX, one
    step smaller in magnitude (the scale is rounded up; the codes round to nearest)."""
    over = np.abs(E4M3[bits] * s.astype(np.float32)) > VALUE_MAX
    if over.any():
        bits = bits.copy()
        bits[over] -= 1  # (the low 7 bits order the magnitudes; an overflowing code is not 0)
    return bits


def kv_split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x[0], x[1]  # K [H, T, D], V [H, T, D]


def group_param(params: dict[str, Any]) -> int:
    g = params.get("group", 32)
    if type(g) is not int or not 1 <= g <= 1 << 16:
        raise CorruptionError(f"codec parameter 'group' must be an int in 1..65536, got {g!r}")
    return g


# A lossy extent decodes in two steps: its bytes are parsed and checked into parts (codes and
# scales, numpy, on the CPU), then the parts are assembled into values with numpy or, for an
# object headed for a device, with torch there.  Each half of a KV layer (or a vectors block) is
# one of: ("scaled", q, s): x = q * s; ("minmax", lo, st, c, group, axis): x = lo + c * st of
# the element's group; ("plain", x); ("sign", m, bits): x = m where the bit is 1, else -m.


def assemble_numpy(parts: list[tuple[Any, ...]]) -> np.ndarray:
    out = []
    for kind, *a in parts:
        if kind == "scaled":
            out.append(a[0] * a[1])
        elif kind == "minmax":
            out.append(minmax_decode(*a))
        elif kind == "plain":
            out.append(a[0])
        else:
            out.append(np.where(a[1] == 1, a[0], -a[0]).astype(np.float32))
    return np.stack(out) if len(out) == 2 else out[0]


def assemble_torch(parts: list[tuple[Any, ...]], device: str) -> Any:
    """As ``assemble_numpy``, with the arithmetic on ``device`` (the parts are copied there)."""
    import torch

    dev = torch.device(device)

    def t(a: np.ndarray) -> Any:
        a = np.ascontiguousarray(a)
        return torch.from_numpy(a if a.flags.writeable else a.copy()).to(dev)

    out = []
    for kind, *a in parts:
        if kind == "scaled":
            out.append(t(a[0]) * t(a[1]))
        elif kind == "minmax":
            lo, st, c, group, axis = t(a[0]), t(a[1]), t(a[2]).to(torch.float32), a[3], a[4]
            idx = torch.arange(c.shape[axis], device=dev) // group
            cm = c.movedim(axis, -1)
            out.append((lo[..., idx] + cm * st[..., idx]).movedim(-1, axis))
        elif kind == "plain":
            out.append(t(a[0]))
        else:
            m = t(a[0])
            out.append(torch.where(t(a[1]) == 1, m, -m))
    return torch.stack(out) if len(out) == 2 else out[0]
