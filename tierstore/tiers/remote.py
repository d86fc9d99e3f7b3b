"""The remote tier: stored records on a Redis or Valkey server (standalone or Redis Cluster),
shared by every store ("node") that names the same server (SPEC.md §14).

It owns the remote layout (key names, the value envelope, the compare-and-set of versions),
the client, its failures and the push queue.  Failures never leave this module as exceptions
on the read path: they become counted misses (``RemoteDown`` to the caller, which then serves
what it has locally).  It never opens a segment or the index: the handle gives it records to
send and ``load`` (the current local record of a key) for the queue, and reads what it fetches.

Versions: every object version has one, ``(stamp, origin)``: a hybrid clock in Unix
nanoseconds and the uuid of the store that wrote it, ordered as a tuple.  The server keeps the
newest: a put or a tombstone is applied by a script that compares versions (§14.3), so a late
or repeated send never replaces a newer value and never resurrects a deleted one.
"""

from __future__ import annotations

import collections
import fcntl
import json
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from ..errors import CorruptionError, InvalidObject, StoreIOError, TierstoreError
from ..format import constants as fmt
from ..format import record as rec

_log = logging.getLogger("tierstore.remote")

POLICIES = ("write-through", "write-back", "read-only")
SCHEMES = {"redis": False, "rediss": False, "valkey": False, "valkeys": False,
           "redis+cluster": True, "rediss+cluster": True, "valkey+cluster": True, "valkeys+cluster": True}
ENV_USER, ENV_PASSWORD = "TIERSTORE_REMOTE_USER", "TIERSTORE_REMOTE_PASSWORD"
LATENCY_SAMPLES = 4096
QUEUE_DEFAULT = 65536  # pushes waiting for the remote (keys, not bytes: the bytes stay in the log)
HEADER_GUESS = 2048  # a ranged read fetches this much of the record first (a 64-layer KV header fits)
FETCH_PIECE = 1 << 20  # bytes per GETRANGE of a fetch (redis-py: ~2x the rate of one 32 MiB GET here)
FETCH_TRIES = 3  # reads of a value replaced while fetched before the fetch is a miss
VERIFY_BATCH = 256  # names per pipeline of ``verify`` (fsck --remote)
VERIFY_BATCH_BYTES = 16 << 20  # values per pipeline of ``verify``, in bytes
UNVERSIONED = (0, bytes(16))  # objects written before the store had a remote

# Compare-and-set (SPEC.md §14.3).  KEYS[1] the object's key, KEYS[2] a staged value (a put);
# ARGV[1] the new envelope (48 bytes).  Byte-wise version comparison: no locale-dependent
# string comparison.  Returns 1 (applied), 0 (the server holds a newer version), 2 (it holds
# this very version: a repeated send), -1 (the staged value is gone: expired or evicted before
# the swap).  A current value whose envelope is not one (§14.2: its magic, layout, flags,
# reserved fields, stamp below 2^63, a tombstone without a record, CRC-32C -- computed bit by
# bit, only when it would win) is no version: anything replaces it, as a reader reads no value
# there (a flipped stamp byte kept every later put of the key out for decades).
CAS_SCRIPT = """
local function zeros(s, i, j)
  for n = i, j do
    if string.byte(s, n) ~= 0 then return false end
  end
  return true
end
local function sound(cur)
  if #cur ~= 48 or string.sub(cur, 1, 4) ~= 'TSRV' or string.byte(cur, 5) ~= 1 then return false end
  local flags = string.byte(cur, 6)
  if flags > 1 or not zeros(cur, 7, 8) or not zeros(cur, 41, 44) or string.byte(cur, 9) >= 128
      or (flags == 1 and not zeros(cur, 33, 40)) then
    return false
  end
  local crc = -1
  for i = 1, 44 do
    crc = bit.bxor(crc, string.byte(cur, i))
    for _ = 1, 8 do
      crc = bit.bxor(bit.rshift(crc, 1), bit.band(0x82F63B78, -bit.band(crc, 1)))
    end
  end
  local stored = ((string.byte(cur, 45) * 256 + string.byte(cur, 46)) * 256 + string.byte(cur, 47)) * 256
    + string.byte(cur, 48)
  return bit.bnot(crc) == bit.tobit(stored)
end
local cur = redis.call('GETRANGE', KEYS[1], 0, 47)
local new = ARGV[1]
if #cur == 48 and string.sub(cur, 1, 4) == 'TSRV' and string.byte(cur, 9) < 128 then
  local order = 0
  for i = 9, 32 do
    local a, b = string.byte(new, i), string.byte(cur, i)
    if a ~= b then order = a > b and 1 or -1; break end
  end
  if order <= 0 and sound(cur) then
    if #KEYS == 2 then redis.call('DEL', KEYS[2]) end
    if order == 0 then return 2 end
    return 0
  end
end
if #KEYS == 2 then
  if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
  redis.call('RENAME', KEYS[2], KEYS[1])
  redis.call('PERSIST', KEYS[1])
else
  redis.call('SET', KEYS[1], new)
end
return 1
"""
STAGE_TTL_MS = 60_000  # a staged value a dead client left behind expires
# Stamps at or past STAMP_CEILING (2^63 ns: the year 2262) are damage -- no clock writes one --
# and the compare-and-set replaces such a value whatever the new stamp.  A clock takes in only
# stamps at most FUTURE_NS ahead of itself: a crafted stamp cannot move a node's clock (and with
# it every later put of the node) out of reach; a value stamped further ahead still counts
# (another node's clock may be that wrong), it is just not outranked until real time passes it.
STAMP_CEILING = 1 << 63
FUTURE_NS = 86_400 * 10**9
OWN_CEILING = 1 << 62  # (the year 2116: a REMOTE file saying more is damaged; 2^62 stamps to go)
VALUE_MAX_DEFAULT = 512 << 20  # Redis's proto-max-bulk-len by default: the largest value it takes


class RemoteDown(Exception):
    """The remote did not answer (or refused): the caller degrades to local-only.  Internal to
    the handle and this module; never raised to users."""


class RemoteRefused(RemoteDown):
    """The server answered and refused this command (a value larger than it takes, a key of
    another type under the name): trying the same send again will not help, other keys' may."""


class Version(NamedTuple):
    """An object version: ordered by stamp, then origin."""

    stamp: int
    origin: bytes


class Remote(NamedTuple):
    """What the server holds for a key: a version and whether it is a tombstone."""

    version: Version
    tombstone: bool
    record_len: int


# -- URLs and credentials --------------------------------------------------------------------

class Target(NamedTuple):
    cluster: bool
    tls: bool
    hosts: tuple[tuple[str, int], ...]
    db: int
    username: str | None
    password: str | None
    shown: str  # the URL without credentials (errors, logs, stats)


def parse_url(url: str) -> Target:
    """``redis://[user:password@]host:port/db``, ``rediss://`` (TLS), ``valkey://``, and
    ``redis+cluster://h1:p1,h2:p2`` (a Redis Cluster; db 0).  The password may instead come from
    TIERSTORE_REMOTE_PASSWORD (and the user from TIERSTORE_REMOTE_USER)."""
    if not isinstance(url, str):
        raise InvalidObject(f"remote= is a URL string like 'redis://host:6379/0', got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        shown = scheme.split(":")[0] if not sep else scheme  # never the rest: it may hold a password
        raise InvalidObject(f"remote=: not a URL of the form scheme://host:port (scheme {shown!r})" if not sep
                            else f"remote=: unsupported URL scheme {shown!r}",
                            hint="use redis://host:6379/0, rediss:// (TLS), valkey://, or redis+cluster://h1:p1,h2:p2")
    scheme = scheme.lower()
    cluster, tls = SCHEMES[scheme], scheme.split("+")[0] in ("rediss", "valkeys")
    userinfo, at, hostpath = rest.rpartition("@")  # credentials first: they may hold '/' or ','
    if "?" in hostpath or "#" in hostpath:  # (redis-py reads options there; these would be dropped unread)
        raise InvalidObject(f"remote=: options in the URL ({'?' if '?' in hostpath else '#'}...) are not read",
                            hint="give them to tierstore.open: remote_timeout=, remote_connect_timeout=, "
                                 "remote_retry_s=, remote_queue= (the password may come from "
                                 f"{ENV_PASSWORD})")
    hostpart, _, path = hostpath.partition("/")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")  # redis://user@host: a user (as redis-py reads it),
        username = urllib.parse.unquote(user) or None  # the password from the environment
        password = urllib.parse.unquote(pw) if colon else None
    password = password or os.environ.get(ENV_PASSWORD) or None
    username = username or os.environ.get(ENV_USER) or None
    hosts = []
    for part in hostpart.split(","):
        host, colon, port = part.strip().rpartition(":")
        if not colon:
            host, port = part.strip(), "6379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidObject(f"remote=: bad host:port {part!r} in {scheme}://{hostpart}")
        hosts.append((host, int(port)))
    if len(hosts) > 1 and not cluster:
        raise InvalidObject("remote=: several hosts need a cluster URL", hint=f"{scheme}+cluster://{hostpart}")
    db = 0
    if path:
        if not path.isdigit():
            raise InvalidObject(f"remote=: the database is a number, got {path!r}")
        db = int(path)
        if cluster and db:
            raise InvalidObject("remote=: a Redis Cluster has only database 0")
    shown = f"{scheme}://{','.join(f'{h}:{p}' for h, p in hosts)}" + (f"/{db}" if db else "")
    return Target(cluster, tls, tuple(hosts), db, username, password, shown)


def remote_key(ns: bytes, k: bytes) -> bytes:
    """The server key of (namespace, key): ts1:<ns hex>:{<key hex>} (SPEC.md §14.1)."""
    return b"%s%s:{%s}" % (fmt.REMOTE_PREFIX, ns.hex().encode(), k.hex().encode())


def namespace_pattern(ns: bytes) -> bytes:
    return b"%s%s:{*}" % (fmt.REMOTE_PREFIX, ns.hex().encode())


def parse_remote_key(name: bytes) -> tuple[bytes, bytes] | None:
    """(namespace, key) of a server key of the layout, or None."""
    if not name.startswith(fmt.REMOTE_PREFIX) or not name.endswith(b"}"):
        return None
    body = name[len(fmt.REMOTE_PREFIX):-1]
    ns_hex, sep, key_hex = body.partition(b":{")
    try:
        return bytes.fromhex(ns_hex.decode()), bytes.fromhex(key_hex.decode())
    except ValueError:
        return None


# -- values ------------------------------------------------------------------------------------

def envelope(version: Version, record_len: int, tombstone: bool = False) -> bytes:
    """The 48-byte envelope that starts every value (SPEC.md §14.2)."""
    body = fmt.REMOTE_ENVELOPE.pack(fmt.REMOTE_MAGIC, fmt.REMOTE_LAYOUT,
                                    fmt.REMOTE_FLAG_TOMBSTONE if tombstone else 0, 0, version.stamp,
                                    version.origin, record_len, 0, 0)
    crc = rec.crc32c(body[:fmt.REMOTE_ENVELOPE_CRC_OFFSET])
    return body[:fmt.REMOTE_ENVELOPE_CRC_OFFSET] + crc.to_bytes(4, "big")


def parse_envelope(b: bytes) -> Remote:
    """Check and decode an envelope; CorruptionError if it is not one."""
    if len(b) < fmt.REMOTE_ENVELOPE.size:
        raise CorruptionError(f"remote value of {len(b)} bytes: shorter than its envelope")
    magic, layout, flags, reserved, stamp, origin, record_len, reserved2, crc = \
        fmt.REMOTE_ENVELOPE.unpack_from(b, 0)
    if magic != fmt.REMOTE_MAGIC:
        raise CorruptionError("remote value: bad magic (not written by tierstore)")
    if rec.crc32c(memoryview(b)[:fmt.REMOTE_ENVELOPE_CRC_OFFSET]) != crc:
        raise CorruptionError("remote value: envelope checksum mismatch")
    if layout != fmt.REMOTE_LAYOUT:
        raise CorruptionError(f"remote value: layout {layout} (this reader knows {fmt.REMOTE_LAYOUT})")
    if flags & ~fmt.REMOTE_FLAGS_KNOWN or reserved or reserved2:
        raise CorruptionError("remote value: unknown flags or non-zero reserved fields")
    if stamp >= STAMP_CEILING:  # (0: an object put before its store had a remote)
        raise CorruptionError("remote value: a version stamp past 2^63 (the year 2262): not a clock's")
    tomb = bool(flags & fmt.REMOTE_FLAG_TOMBSTONE)
    if tomb and record_len:
        raise CorruptionError("remote value: a tombstone with a record length")
    return Remote(Version(stamp, origin), tomb, record_len)


def version_of(hdr: rec.RecordHeader) -> Version:
    """The version a PUT record carries (meta ``version``), or UNVERSIONED."""
    v = hdr.meta.get(fmt.META_VERSION)
    if (type(v) is list and len(v) == 2 and type(v[0]) is int and 0 < v[0] < 1 << 64
            and type(v[1]) is bytes and len(v[1]) == 16):
        return Version(v[0], v[1])
    return Version(*UNVERSIONED)


def check_fetched(ns: bytes, k: bytes, value: Any, *, full: bool = True) -> tuple[Remote, rec.RecordHeader]:
    """Validate a fetched value (or, without ``full``, its envelope and header only): the
    envelope, the record header (SPEC.md §4.4), that the record is this key's, that its version
    is the envelope's and (``full``) every extent checksum.  CorruptionError otherwise."""
    env = parse_envelope(bytes(value[:fmt.REMOTE_ENVELOPE.size]))
    if env.tombstone:
        if len(value) != fmt.REMOTE_ENVELOPE.size:
            raise CorruptionError("remote value: a tombstone with a body")
        return env, None  # type: ignore[return-value]
    view = memoryview(value)[fmt.REMOTE_ENVELOPE.size:]
    if full and len(view) != env.record_len:
        raise CorruptionError(f"remote value truncated or padded: {len(view)} record bytes, envelope says "
                              f"{env.record_len}")
    hdr = rec.decode_header(view)
    if hdr.type != fmt.REC_PUT or hdr.namespace != ns or hdr.key != k:
        raise CorruptionError("remote value belongs to another key")
    if hdr.record_len != env.record_len or version_of(hdr) != env.version:
        raise CorruptionError("remote value: the record's version or length is not the envelope's")
    if full:
        for off, n, crc in zip(hdr.offsets, hdr.extent_lengths, hdr.extent_crcs):
            if rec.crc32c(view[off:off + n]) != crc:
                raise CorruptionError("remote value: extent checksum mismatch")
    return env, hdr


def fetch_plan(spans: Sequence[tuple[int, int]], have: int, piece: int) -> list[tuple[int, int]]:
    """The byte ranges [lo, hi) to ``GETRANGE`` for the value bytes ``spans`` (ascending extents)
    past the first ``have``: neighbouring spans joined (with the padding between them) while a
    range stays within ``piece`` bytes, a longer span cut into ``piece``-byte ranges."""
    reqs: list[tuple[int, int]] = []
    for lo, hi in spans:
        lo = max(lo, have)
        if lo >= hi:
            continue
        if reqs and lo >= reqs[-1][1] and hi - reqs[-1][0] <= piece:
            reqs[-1] = (reqs[-1][0], hi)
            continue
        while hi - lo > piece:
            reqs.append((lo, lo + piece))
            lo += piece
        reqs.append((lo, hi))
    return reqs


def gather(bufs: Sequence[tuple[int, memoryview]], lo: int, hi: int) -> Any:
    """Value bytes [lo, hi) out of ``bufs`` = [(offset in the value, bytes read there)]: one
    memoryview where one buffer holds them, else ``rec.Pieces`` of the buffers' slices in order
    (shorter than ``hi - lo`` where the value ended first)."""
    parts = []
    for start, buf in bufs:
        a, b = max(lo, start), min(hi, start + buf.nbytes)
        if a < b:
            parts.append(buf[a - start:b - start])
    if len(parts) == 1:
        return parts[0]
    return rec.Pieces(parts) if parts else memoryview(b"")


class BufferReader:
    """An ExtentReader (format/block.py) over a fetched record: extents are views of it (or
    ``rec.Pieces`` of views, for an extent fetched in pieces), with their checksums verified
    when the value was fetched (``check_fetched``, ``RemoteTier.fetch_extents``)."""

    def __init__(self, hdr: rec.RecordHeader, value: Any, base: int = fmt.REMOTE_ENVELOPE.size,
                 extents: dict[int, memoryview] | None = None) -> None:
        self.hdr = hdr
        view = memoryview(value)
        self.extents = extents if extents is not None else {
            i: view[base + off:base + off + n] for i, (off, n) in enumerate(zip(hdr.offsets, hdr.extent_lengths))}

    def read_into(self, wanted: Sequence[tuple[int, memoryview]]) -> None:
        for i, dest in wanted:
            ext = self.extents[i]
            if type(ext) is rec.Pieces:
                pos = 0
                for p in ext:
                    dest[pos:pos + p.nbytes] = p
                    pos += p.nbytes
            else:
                dest[:] = ext

    def read_bytes(self, index: int) -> bytes:
        ext = self.extents[index]
        return ext.tobytes() if type(ext) is rec.Pieces else bytes(ext)

    def record(self) -> rec.EncodedRecord:
        """The fetched record as one to append to the local log (its header is restamped there)."""
        return rec.EncodedRecord(self.hdr, tuple(self.extents[i] for i in range(len(self.hdr.extent_lengths))))


# -- the clock -------------------------------------------------------------------------------

class Clock:
    """A hybrid clock: Unix nanoseconds, strictly increasing within the process."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._last = max(time.time_ns(), self._last + 1)
            return self._last

    @property
    def last(self) -> int:
        return self._last

    def seen(self, stamp: int, *, own: bool = False) -> None:
        """A version was seen: later stamps of this process exceed it (so an overwrite is newer
        than what it overwrote, whatever the clocks' skew).  Another node's stamp is taken in
        only up to ``FUTURE_NS`` ahead of the wall clock (not of this clock: crafted stamps, each
        a day past the last, would otherwise carry every later stamp of this process to where
        they overflow); the store's ``own`` stamps (REMOTE's ``pushed_to``: a clock once fast,
        since set right) up to ``OWN_CEILING``."""
        with self._lock:
            if stamp <= (OWN_CEILING if own else time.time_ns() + FUTURE_NS):
                self._last = max(self._last, stamp)


CLOCK = Clock()  # one per process: the stamps of its handles (with remote= or beside one) never tie


RESERVE_AHEAD_NS = 10**9  # a reservation covers the stamps of the next second (one synced write a second)
RESERVE_BEYOND_NS = 10**6  # ... or a millisecond past stamps that run further ahead of the wall clock


class Stamps:
    """The stamps one store's handles issue (SPEC.md §14.6): the process clock, and a
    reservation in the store's STAMPS file that is always above every stamp handed out.

    Before a stamp past its reservation is handed out, a handle raises the file's reservation to
    a second past the wall clock, or just past the stamp when stamps run further ahead than that
    (the file's flock, a synced write): a crash can leave it above what was issued, never below.
    A handle that opens (or first stamps) with its wall clock below the largest stamp that made
    a handle reserve -- the clock was set back, or the store stamped ahead of it -- takes the
    reservation into its clock, so its stamps outrank every version the store wrote; stamps
    already ahead move only a millisecond further at such a reopen."""

    def __init__(self, path: str, clock: Clock = CLOCK) -> None:
        self.path, self.clock = path, clock
        self._lock = threading.Lock()
        reserved, stamp = self._read()
        self.reserved = 0  # what this handle reserved: its stamps up to it need no write
        if time.time_ns() < stamp:  # the clock is below a stamp the store issued: set back (or the
            # stamps ran ahead of it): stamps up to the reservation may have been issued.  (Not
            # merely below the reservation: another live handle's always is, a second ahead, and
            # taking it in made a process beside it stamp ahead of that handle's later puts)
            clock.seen(reserved, own=True)

    def _read(self) -> tuple[int, int]:
        """(reserved, stamp) of the valid slot with the larger reservation; (0, 0) without one."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(fmt.STAMPS_SLOT.size * fmt.STAMPS_SLOTS)
        except FileNotFoundError:
            return 0, 0
        except OSError as e:
            raise StoreIOError(f"read {fmt.STAMPS_FILE}: {e.strerror or e}", errno=e.errno, poisoned=False,
                               path=self.path) from None
        best = _best_slot(data)
        if best is None:
            if data:
                _log.warning("%s: no valid slot: stamps issued before are not known (a clock set back may "
                             "stamp below them)", self.path)
            return 0, 0
        return best[1], best[2]

    def next(self) -> int:
        """The next stamp, reserved durably before it is returned (StoreIOError if it cannot be)."""
        stamp = self.clock.next()
        if stamp > self.reserved:
            with self._lock:
                if stamp > self.reserved:
                    self.reserved = self._reserve(stamp)  # (its own: another handle's is theirs)
        return stamp

    def _reserve(self, stamp: int) -> int:
        """Raise the file's reservation above ``stamp``; returns the reservation written."""
        slot = fmt.STAMPS_SLOT
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StoreIOError(f"open {fmt.STAMPS_FILE}: {e.strerror or e}", errno=e.errno, poisoned=False,
                               path=self.path) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # (released by the close: other handles read, then write, too)
            data = os.pread(fd, slot.size * fmt.STAMPS_SLOTS, 0)
            best = _best_slot(data)
            have, seen = (best[1], best[2]) if best is not None else (0, 0)
            # a second past the wall clock (one write a second), or just past stamps that run
            # further ahead -- a second past *them* moved stamps a second further at every reopen
            mine = max(stamp + RESERVE_BEYOND_NS, time.time_ns() + RESERVE_AHEAD_NS)
            reserved = max(have, mine)
            # the slot not holding the valid reservation: a torn write leaves that one
            index = 0 if best is None else 1 - best[0]
            os.pwrite(fd, _pack_slot(reserved, max(seen, stamp)), index * slot.size)
            os.fdatasync(fd)
            if len(data) < slot.size:  # a new file: its name too must survive a crash
                _fsync_dir(self.path)
        except OSError as e:
            raise StoreIOError(f"reserve version stamps in {fmt.STAMPS_FILE}: {e.strerror or e}", errno=e.errno,
                               poisoned=False, path=self.path) from None
        finally:
            os.close(fd)
        return mine


def _pack_slot(reserved: int, stamp: int) -> bytes:
    """A STAMPS slot, its CRC-32C over its first 16 bytes."""
    head = fmt.STAMPS_SLOT.pack(reserved, stamp, 0, 0)[:16]
    return fmt.STAMPS_SLOT.pack(reserved, stamp, rec.crc32c(head), 0)


def _best_slot(data: bytes) -> tuple[int, int, int] | None:
    """(index, reserved, stamp) of the valid STAMPS slot with the larger reservation."""
    slot = fmt.STAMPS_SLOT
    best = None
    for i in range(fmt.STAMPS_SLOTS):
        raw = data[i * slot.size:(i + 1) * slot.size]
        if len(raw) < slot.size:
            break
        reserved, stamp, crc, zero = slot.unpack(raw)
        if crc != rec.crc32c(raw[:16]) or zero or stamp > reserved or reserved > OWN_CEILING:
            continue
        if best is None or reserved > best[1]:
            best = (i, reserved, stamp)
    return best


# -- the client ------------------------------------------------------------------------------

def connect(target: Target, timeout: float, connect_timeout: float) -> Any:
    """A redis-py client for ``target`` (redis.Redis or redis.cluster.RedisCluster)."""
    try:
        import redis
    except ImportError:
        raise InvalidObject("remote= needs redis-py, which is not installed",
                            hint="pip install 'tierstore[remote]'") from None
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    # no retries inside the client: a failure marks the tier down for retry_s (RemoteTier._call)
    common = {"username": target.username, "password": target.password, "socket_timeout": timeout,
              "socket_connect_timeout": connect_timeout, "retry": Retry(NoBackoff(), 0)}
    if target.tls:
        common["ssl"] = True
        ca = os.environ.get("TIERSTORE_REMOTE_CA")
        if ca:
            common["ssl_ca_certs"] = ca
    if target.cluster:
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.hosts], **common)
    host, port = target.hosts[0]
    return redis.Redis(host=host, port=port, db=target.db, **common)


def _redis_errors() -> tuple[type[BaseException], ...]:
    """What redis-py raises when a server fails: its errors, the cluster client's (which do not
    derive from RedisError), and socket errors."""
    try:
        import redis
    except ImportError:
        raise InvalidObject("remote= needs redis-py, which is not installed",
                            hint="pip install 'tierstore[remote]'") from None
    return (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)


class RemoteTier:
    """The remote tier of one handle.  Thread-safe (redis-py clients are).

    Every call either answers or raises ``RemoteDown`` after counting the failure; after a
    failure the tier stays *down* (answers ``RemoteDown`` at once, without a round trip) for
    ``retry_s``, so a dead server costs one timeout, not one per call.
    """

    def __init__(self, url: str, *, origin: bytes, policy: str = "write-through", timeout: float = 2.0,
                 connect_timeout: float = 1.0, retry_s: float = 1.0, queue: int = QUEUE_DEFAULT,
                 state_path: str | None = None, stamps_path: str | None = None) -> None:
        check_settings(policy=policy, timeout=timeout, connect_timeout=connect_timeout, retry_s=retry_s, queue=queue)
        self.target = parse_url(url)
        self.url = self.target.shown
        self.policy = policy
        self.origin = origin
        self.retry_s, self.timeout, self.connect_timeout = retry_s, timeout, connect_timeout
        self.clock = CLOCK
        self.counters = {"hits": 0, "misses": 0, "stale": 0, "bad_values": 0, "bytes_in": 0, "bytes_out": 0,
                         "puts": 0, "put_conflicts": 0, "put_repeats": 0, "tombstones": 0, "errors": 0, "full": 0,
                         "skipped": 0, "queued": 0, "queue_dropped": 0, "resent": 0, "not_cached": 0, "refused": 0}
        self._latency: collections.deque[float] = collections.deque(maxlen=LATENCY_SAMPLES)
        self._down_until = 0.0
        self._down_logged = False
        self._full_logged = False
        self._bad_logged: set[bytes] = set()
        self._damaged: dict[bytes, Version] = {}  # name -> the version of a value whose body failed its checks
        self._counting = threading.Lock()
        self._refusals_logged: set[str] = set()
        self._errors = _redis_errors()
        self._client: Any = None  # connected on first use: a server down at open is a failure counted
        self._cas: Any = None
        self.value_max: int | None = None  # the server's proto-max-bulk-len, read by the first put
        self._connect_lock = threading.Lock()
        self.queue = PushQueue(self, queue, state_path)
        self.clock.seen(self.queue.pushed_to, own=True)
        self.stamps = Stamps(stamps_path, self.clock) if stamps_path is not None else None

    def next_stamp(self) -> int:
        """A stamp for a version this store writes (reserved in STAMPS when the tier writes)."""
        return self.stamps.next() if self.stamps is not None else self.clock.next()

    # -- plumbing --------------------------------------------------------------------------

    @property
    def writes(self) -> bool:
        return self.policy != "read-only"

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    @property
    def down_for(self) -> float:
        """Seconds until the next try, when down."""
        return self._down_until - time.monotonic()

    @property
    def client(self) -> Any:
        """The redis-py client, connected on first use (a cluster client reads the slot map then)."""
        if self._client is None:
            with self._connect_lock:
                if self._client is None:
                    client = connect(self.target, self.timeout, self.connect_timeout)
                    self._cas = client.register_script(CAS_SCRIPT)
                    self._client = client
        return self._client

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.down:
            self.count("skipped")
            raise RemoteDown("remote marked down")
        t0 = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
        except self._errors as e:
            if self._failed(e):
                raise RemoteRefused(self._scrub(str(e))) from None
            raise RemoteDown(self._scrub(str(e))) from None
        self._latency.append((time.perf_counter() - t0) * 1e3)
        if self._down_logged:
            _log.warning("remote %s answers again", self.url)
            self._down_logged = False
        self._full_logged = False
        return out

    def _scrub(self, text: str) -> str:
        pw = self.target.password
        return text.replace(pw, "***") if pw else text

    def _failed(self, e: BaseException) -> bool:
        """Count (and log) a failure; True if the server refused the command itself."""
        import redis

        text = self._scrub(str(e))
        if "OOM" in text or "maxmemory" in text:
            self.count("full")  # a full server (noeviction): an error counted, not down; logged
            if not self._full_logged:  # once until a command succeeds again
                self._full_logged = True
                _log.warning("remote %s is full: %s", self.url, text)
            return False
        if type(e) is redis.exceptions.ResponseError:  # one command refused (e.g. a foreign key's type,
            self.count("errors")  # a database out of range): counted and logged once per kind;
            kind = text.split("error: ")[-1].split(" ")[0][:40]  # (a pipeline's: "Command # n ... error: X")
            if kind not in self._refusals_logged and len(self._refusals_logged) < 100:
                self._refusals_logged.add(kind)
                _log.warning("remote %s refused a command: %s", self.url, text)
            # for good only where this key's send can never succeed as it is; others (NOREPLICAS,
            # MISCONF, BUSY, ...) pass, and the send is tried again
            # (pipelines prefix "Command # n ...", Redis 6 scripts "ERR Error running script ...")
            return _refuses_key(text)
        self.count("errors")
        self._down_until = time.monotonic() + self.retry_s
        if not self._down_logged:
            if isinstance(e, redis.exceptions.AuthenticationError) and "HELLO" in text and \
                    self.target.password is None:  # (Redis's own words only say the client is not authenticated)
                text += f" -- the server wants a password: give it in the URL or in {ENV_PASSWORD}"
            _log.warning("remote %s unavailable (%s: %s); serving local data only, retrying every %.1f s",
                         self.url, type(e).__name__, text, self.retry_s)
            self._down_logged = True

    def _log_refusal(self, kind: str, text: str) -> None:
        """A send refused before it was tried (too large for the server): logged once per kind."""
        self.count("errors")
        if kind not in self._refusals_logged and len(self._refusals_logged) < 100:
            self._refusals_logged.add(kind)
            _log.warning("remote %s: %s", self.url, text)

    def count(self, name: str, n: int = 1) -> None:
        """Add to a counter (callers' threads and the push queue's count at once)."""
        with self._counting:
            self.counters[name] += n

    def bad_value(self, name: bytes, why: str, head: Any = None) -> None:
        """A value that failed its checks: a miss, counted, logged once per key.  ``head``: the
        value's first bytes, when fetched; if its envelope is sound, that version of the key is
        remembered as damaged, so ``states`` (``contains``) stops reporting it until it is
        replaced."""
        self.count("bad_values")
        if head is not None and len(self._damaged) < 10_000:
            try:
                self._damaged[name] = parse_envelope(bytes(head[:fmt.REMOTE_ENVELOPE.size])).version
            except CorruptionError:
                pass
        if name not in self._bad_logged and len(self._bad_logged) < 10_000:
            self._bad_logged.add(name)
            _log.warning("remote %s: ignoring damaged value of %r: %s", self.url, name, why)

    def close(self, drain_s: float = 5.0) -> None:
        """Send what the queue holds (for at most ``drain_s``), save its state, disconnect."""
        try:
            self.queue.close(drain_s)
        finally:
            if self._client is not None:
                self._client.close()

    def stats(self) -> dict[str, Any]:
        lat = sorted(self._latency)

        def pct(q: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else None

        return {"url": self.url, "policy": self.policy, "down": self.down, **self.counters,
                "queue_length": len(self.queue), "tombstones_pending": self.queue.tombstones_pending,
                "latency_ms_p50": pct(0.5), "latency_ms_p99": pct(0.99)}

    # -- reading ---------------------------------------------------------------------------

    def ping(self) -> None:
        """RemoteDown unless the server answers."""
        self._call(lambda: self.client.ping())

    def state(self, ns: bytes, k: bytes) -> Remote | None:
        """What the server holds for the key (its envelope), None if nothing (or a damaged value)."""
        name = remote_key(ns, k)
        head = self._call(lambda: self.client.getrange(name, 0, fmt.REMOTE_ENVELOPE.size - 1))
        return self._envelope(name, head)

    def states(self, ns: bytes, ks: Sequence[bytes], *, sound: bool = False) -> list[Remote | None]:
        """``state`` of many keys with one pipeline.  ``sound`` (``contains``): also None for a
        value whose length is not its envelope's, or whose version's body failed its checks
        when this process last fetched it in full (until a fetch finds it sound again)."""
        if not ks:
            return []
        names = [remote_key(ns, k) for k in ks]

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.getrange(name, 0, fmt.REMOTE_ENVELOPE.size - 1)
                if sound:
                    pipe.strlen(name)
            return pipe.execute()

        got = self._call(run)
        if not sound:
            return [self._envelope(name, head) for name, head in zip(names, got)]
        return [self._sound(name, head, size) for name, head, size in zip(names, got[0::2], got[1::2])]

    def _sound(self, name: bytes, head: bytes, size: int, again: bool = True) -> Remote | None:
        """``_envelope``, and None for a value whose length (``size``) is not its envelope's --
        read once more first: the two reads may straddle another node's swap-in -- or whose
        version's body failed its checks when last fetched."""
        env = self._envelope(name, head)
        if env is None:
            return None
        expected = fmt.REMOTE_ENVELOPE.size + env.record_len
        if size != expected:
            if again:
                head, size = self._call(lambda: self.client.pipeline(transaction=False)
                                        .getrange(name, 0, fmt.REMOTE_ENVELOPE.size - 1).strlen(name).execute())
                return self._sound(name, head, size, again=False)
            self.bad_value(name, f"value of {size} bytes, its envelope says {expected}")
            return None
        return None if self._damaged.get(name) == env.version else env

    def _envelope(self, name: bytes, head: bytes) -> Remote | None:
        """A value's state from its first bytes: None if nothing or its envelope is unsound."""
        if not head:
            return None
        try:
            env = parse_envelope(head)
        except CorruptionError as e:
            self.bad_value(name, e.message)
            return None
        self.clock.seen(env.version.stamp)
        return env

    def fetch(self, ns: bytes, k: bytes) -> tuple[Remote, BufferReader | None] | None:
        """The key's whole value, checked (``check_fetched``): (state, reader over the record; None
        for a tombstone), or None when the server holds nothing usable (a miss, counted).  Read
        in pieces (``fetch_extents``): redis-py takes a 32 MiB bulk reply at about half the rate
        of the same bytes in 1 MiB replies."""
        return self.fetch_extents(ns, k, None)

    def fetch_extents(self, ns: bytes, k: bytes, wanted: Callable[[rec.RecordHeader], list[int]] | None
                      ) -> tuple[Remote, BufferReader | None] | None:
        """The extents ``wanted(header)`` names of the key's value (None: the whole value), checked:
        (state, reader over them; None for a tombstone), or None for a miss (counted).

        One ``GETRANGE`` of the value's start (the envelope and the header, and for a whole
        value its first ``FETCH_PIECE`` bytes), then, when more is needed, one pipeline of the
        envelope, ``STRLEN``, ``GETRANGE`` pieces of at most ``FETCH_PIECE`` bytes (whole extents
        where they fit) and the envelope again.  A value is swapped in whole and versions only
        grow, so when both envelopes are the first read's, every piece is of that version;
        otherwise another node replaced the value in between and the fetch starts again (a
        replaced value is neither mixed with the old one nor reported as damaged).  (Not a
        ``MULTI``: redis-py's cluster transactions do not follow a slot's ASK or MOVED
        redirects, a pipeline does.)"""
        name = remote_key(ns, k)
        env_size = fmt.REMOTE_ENVELOPE.size
        first = FETCH_PIECE if wanted is None else env_size + HEADER_GUESS
        for _ in range(FETCH_TRIES + 1):  # (one more for a header longer than the first read)
            head = self._call(lambda first=first: self.client.getrange(name, 0, first - 1))
            if not head:
                self.count("misses")
                return None
            self.count("bytes_in", len(head))
            try:
                env = parse_envelope(head)
                if env.tombstone:
                    check_fetched(ns, k, head, full=False)  # (a tombstone with a body is damaged)
                    self.clock.seen(env.version.stamp)
                    if wanted is None:
                        self._damaged.pop(name, None)  # (sound now: deleted)
                    self.count("misses")
                    return env, None
                hdr_len = rec.parse_fixed(memoryview(head)[env_size:]).header_len  # bounds checked (SPEC.md §4.4)
                if env_size + hdr_len > len(head):
                    if len(head) == first:  # a header longer than the guess: read it whole, at once
                        first = env_size + hdr_len
                        continue
                    raise CorruptionError("remote value truncated in its record header")
                _, hdr = check_fetched(ns, k, head, full=False)
                want = list(range(len(hdr.offsets))) if wanted is None else wanted(hdr)
                got = self._rest(name, head, len(head) < first, hdr, want, whole=wanted is None)
                if got is None:  # replaced meanwhile: again, from its new start
                    continue
                extents = {}
                for i in want:
                    ext = got[i]
                    if ext.nbytes != hdr.extent_lengths[i] or rec.extent_crc(ext) != hdr.extent_crcs[i]:
                        raise CorruptionError("remote value: extent truncated or checksum mismatch")
                    extents[i] = ext
            except CorruptionError as e:
                self.bad_value(name, e.message, head)
                self.count("misses")
                return None
            self.clock.seen(env.version.stamp)  # (a value that passed its checks)
            if wanted is None:
                self._damaged.pop(name, None)  # (sound now: replaced, or re-sent after the server lost it)
            if want:  # a header alone (``info``) is not a hit
                self.count("hits")
            return env, BufferReader(hdr, b"", extents=extents)
        self.count("misses")  # replaced again and again while read: nothing usable now
        return None

    def _rest(self, name: bytes, head: bytes, complete: bool, hdr: rec.RecordHeader, want: list[int], *,
              whole: bool) -> dict[int, Any] | None:
        """The bytes of extents ``want`` of the value whose first bytes are ``head`` (``complete``:
        all of it): a memoryview (or ``rec.Pieces`` across pieces) per extent, of the length read
        (the caller checks it); None if the value was replaced since ``head`` was read (an
        envelope read before or after the pieces is not ``head``'s).  With ``whole``, the value
        must be the envelope and record exactly (else CorruptionError)."""
        env_size = fmt.REMOTE_ENVELOPE.size
        spans = [(env_size + hdr.offsets[i], env_size + hdr.offsets[i] + hdr.extent_lengths[i]) for i in want]
        end = env_size + hdr.record_len
        reqs = fetch_plan(spans, len(head), FETCH_PIECE)
        bufs: list[tuple[int, Any]] = [(0, memoryview(head))]
        if reqs or (whole and not complete):  # (STRLEN: is there more than the record?)
            def run() -> list[Any]:
                pipe = self.client.pipeline(transaction=False)
                pipe.getrange(name, 0, env_size - 1)
                pipe.strlen(name)
                for lo, hi in reqs:
                    pipe.getrange(name, lo, hi - 1)
                pipe.getrange(name, 0, env_size - 1)
                return pipe.execute()

            before, size, *parts, after = self._call(run)
            self.count("bytes_in", len(before) + len(after) + sum(len(p) for p in parts))
            if before != head[:env_size] or after != before:
                return None
            if whole and size != end:
                raise CorruptionError(f"remote value truncated or padded: {size - env_size} record bytes, "
                                      f"envelope says {hdr.record_len}")
            bufs += [(lo, memoryview(p)) for (lo, _), p in zip(reqs, parts)]
        elif whole and len(head) != end:  # (complete here)
            raise CorruptionError(f"remote value truncated or padded: {len(head) - env_size} record bytes, "
                                  f"envelope says {hdr.record_len}")
        return {i: gather(bufs, lo, hi) for i, (lo, hi) in zip(want, spans)}

    def scan(self, ns: bytes | None = None, count: int = 1000) -> Iterator[bytes]:
        """Server keys of the layout (of one namespace, or all), over every cluster master."""
        pattern = namespace_pattern(ns) if ns is not None else fmt.REMOTE_PREFIX + b"*"
        for name in self.client.scan_iter(match=pattern, count=count):
            name = name if isinstance(name, bytes) else name.encode()
            if parse_remote_key(name) is not None:
                yield name

    def verify(self, ns: bytes | None = None, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Check every value of the layout (of namespace ``ns``, or all) on the server: envelope,
        record header, that it is its key's, every extent checksum (``tierstore fsck --remote``).
        Values are read whole (each GET is atomic: never half of one version and half of the
        next) in pipelines of ``VERIFY_BATCH`` names and at most ``VERIFY_BATCH_BYTES`` of values
        (a larger value alone): one round trip for many small values.  Raises RemoteDown if the
        server does not answer."""
        import redis

        report: dict[str, Any] = {"remote": self.url, "values": 0, "tombstones": 0, "bytes": 0, "damaged": []}

        def pipelined(fill: Callable[[Any], None]) -> list[Any]:
            def run() -> list[Any]:
                pipe = self.client.pipeline(transaction=False)
                fill(pipe)
                answers = pipe.execute(raise_on_error=False)
                for a in answers:  # a key refused for good (a foreign type) is that key's answer; any
                    if isinstance(a, Exception) and not (  # other error (a cluster node's timeout,
                            type(a) is redis.exceptions.ResponseError and _refuses_key(str(a))):  # NOPERM)
                        raise a  # is the server's: RemoteDown
                return answers
            return self._call(run)

        def refused(name: bytes, answer: Any) -> bool:
            if not isinstance(answer, Exception):
                return False
            self._failed(answer)  # (counted, logged once per kind)
            report["damaged"].append({"key": name.decode("ascii", "replace"),
                                      "why": f"refused: {self._scrub(str(answer))}"})
            return True

        names = self._call(lambda: list(self.scan(ns)))
        for i in range(0, len(names), VERIFY_BATCH):
            batch = names[i:i + VERIFY_BATCH]
            sizes = pipelined(lambda pipe, batch=batch: [pipe.strlen(name) for name in batch])
            groups: list[list[bytes]] = [[]]
            held = 0
            for name, size in zip(batch, sizes):
                if refused(name, size):  # (0: gone since the scan, or an empty value: the GET tells)
                    continue
                if held + size > VERIFY_BATCH_BYTES and groups[-1]:
                    groups.append([])
                    held = 0
                groups[-1].append(name)
                held += size
            for group in groups:
                values = pipelined(lambda pipe, group=group: [pipe.get(name) for name in group]) if group else []
                for name, value in zip(group, values):
                    if value is not None and not refused(name, value):  # (None: deleted since the scan)
                        self._verified(name, value, report, progress)
        report["ok"] = not report["damaged"]
        return report

    @staticmethod
    def _checked(name: bytes, value: Any) -> Remote:
        """The envelope of ``value``, a sound value of the server key ``name`` (``check_fetched``);
        CorruptionError otherwise."""
        parsed = parse_remote_key(name)
        assert parsed is not None
        return check_fetched(parsed[0], parsed[1], value)[0]

    def _verified(self, name: bytes, value: Any, report: dict[str, Any],
                  progress: Callable[[int], None] | None) -> None:
        """Count a value read by ``verify`` in ``report``: a value, a tombstone or a damaged one."""
        report["bytes"] += len(value)
        if progress is not None:
            progress(len(value))
        try:
            env = self._checked(name, value)
        except CorruptionError as e:
            report["damaged"].append({"key": name.decode("ascii", "replace"), "why": e.message})
            return
        report["tombstones" if env.tombstone else "values"] += 1

    # -- writing ---------------------------------------------------------------------------

    def push(self, record: rec.EncodedRecord, version: Version) -> int:
        """Send a PUT record: 1 if the server now holds it, 2 if it held this very version already
        (a repeated send), 0 if it holds a newer one.  The value is staged under a key of the
        same hash slot and swapped in by the compare-and-set script: a reader never sees half a
        value."""
        hdr = record.header
        name = remote_key(hdr.namespace, hdr.key)
        # one stage per send: two sends of one version at once (a push and the queue's sweep) never
        # write into each other's staged bytes
        stage = b"%s:w:%s:%d:%s" % (name, version.origin.hex().encode(), version.stamp, os.urandom(4).hex().encode())
        env = envelope(version, hdr.record_len)
        total = len(env) + hdr.record_len

        def run() -> int:
            client = self.client
            if self.value_max is None:
                self.value_max = _value_max(client)
            if total > self.value_max:
                return -2
            pipe = client.pipeline(transaction=False)
            # the stage's expiry first (a SET with PX), so that whatever fails later in the pipeline
            # leaves nothing for long; SETRANGE keeps it: a client dying mid-upload leaves nothing
            pipe.set(stage, b"", px=STAGE_TTL_MS)
            pipe.setrange(stage, total - 1, b"\0")  # one allocation of the whole value, zeroed
            pos = 0
            for buf in [env, *record.iovecs()]:
                view = rec.byte_view(buf)  # redis-py sizes a value by len(): flat bytes, not an array view
                pipe.setrange(stage, pos, view)
                pos += view.nbytes
            pipe.execute()
            return int(self._cas(keys=[name, stage], args=[env]))

        out = self._call(run)
        if out == -2:
            self._log_refusal("value too large", f"a value of {total} bytes for {name!r}: the server takes at "
                                 f"most {self.value_max} (proto-max-bulk-len); the object stays local")
            raise RemoteRefused("value too large for the server")
        if out == -1:
            raise RemoteDown("the staged value vanished before it was swapped in (server evicting)")
        self.count("bytes_out", total)
        self.count({1: "puts", 2: "put_repeats"}.get(out, "put_conflicts"))
        return out

    def tombstone(self, ns: bytes, k: bytes, version: Version) -> bool:
        """Mark the key deleted at ``version`` (unless the server holds a newer version)."""
        env = envelope(version, 0, tombstone=True)

        def run() -> int:
            client = self.client  # connects (and registers the script) on first use
            return int(self._cas(keys=[remote_key(ns, k)], args=[env], client=client))

        out = self._call(run)
        self.count({1: "tombstones", 2: "put_repeats"}.get(out, "put_conflicts"))
        return out in (1, 2)


def _refuses_key(text: str) -> bool:
    """Whether a server's error refuses one key for good (another type of key under the name, a
    value larger than it takes), not the server being unable to serve (OOM, NOPERM, BUSY,
    CLUSTERDOWN, ...)."""
    return "WRONGTYPE" in text or "exceeds maximum allowed size" in text


def _value_max(client: Any) -> int:
    """The largest value the server takes (its ``proto-max-bulk-len``), or Redis's default where
    CONFIG is not allowed (an ACL, a managed service) or the client is a cluster's."""
    import redis

    try:
        return int(client.config_get("proto-max-bulk-len")["proto-max-bulk-len"])
    except (redis.exceptions.ResponseError, KeyError, TypeError, ValueError):  # refused, or not one answer
        return VALUE_MAX_DEFAULT  # (a server that does not answer raises: the put fails, counted)


def write_state(path: str, data: bytes) -> None:
    """Replace the file at ``path`` with ``data`` atomically and durably (write, fsync, rename,
    fsync the directory)."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path)


def _fsync_dir(path: str) -> None:
    """Sync the directory holding ``path`` (a file created or renamed there survives a crash)."""
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# -- the push queue ----------------------------------------------------------------------------

class PushQueue:
    """Keys whose newest local version the remote has not been sent (write-back puts, and any
    push or tombstone that failed), sent by one thread.  Bounded by ``limit`` keys: past it the
    oldest are dropped from memory, and a *sweep* re-sends from the local log everything newer
    than ``pushed_to`` once the remote answers again.

    ``pushed_to`` (saved in REMOTE, SPEC.md §14.5) is a stamp: every put of this store with an
    older stamp has reached the server.  After a crash, a sweep of the local objects newer
    than it re-sends what may be missing; tombstones not yet sent are saved in REMOTE itself
    (a delete leaves nothing in the log to re-send them from).  Stamps are issued here
    (``issue``) so that none is between the clock and the pending set when ``pushed_to`` moves.
    """

    def __init__(self, tier: RemoteTier, limit: int, state_path: str | None) -> None:
        self.tier, self.limit, self.state_path = tier, limit, state_path
        self._items: collections.OrderedDict[tuple[bytes, bytes], Version] = collections.OrderedDict()
        self._tombs: dict[tuple[bytes, bytes], Version] = {}
        self._pending: collections.Counter[int] = collections.Counter()  # stamps issued, not yet sent
        self._cv = threading.Condition()
        self._save_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.load: Callable[[bytes, bytes], tuple[rec.EncodedRecord, Version] | None] | None = None
        self.sweep_source: Callable[[], Iterator[tuple[bytes, bytes, Version]]] | None = None
        self.pushed_to = 0
        self.sweep_needed = False
        self.sweeping = False
        self._saved: tuple[Any, ...] | None = None
        self._closed = False  # the last save is done: a sender still in flight writes no more
        self.failures = 0  # sends that failed (the sender tries again after ``retry_s``)
        if state_path is not None:
            self._read_state()

    def __len__(self) -> int:
        return len(self._items)

    def _read_state(self) -> None:
        try:
            with open(self.state_path, "rb") as f:  # type: ignore[arg-type]
                state = json.loads(f.read())
            for entry in state.get("tombstones", []):  # each on its own: a bad one loses no other
                try:
                    ns_hex, key_hex, stamp, origin_hex = entry
                    v = Version(int(stamp), bytes.fromhex(origin_hex))
                    if not 0 < v.stamp < STAMP_CEILING or len(v.origin) != 16:
                        raise ValueError(f"stamp {v.stamp}")
                    self._tombs[(bytes.fromhex(ns_hex), bytes.fromhex(key_hex))] = v
                except (ValueError, TypeError) as e:
                    _log.warning("%s: a tombstone entry set aside (%s): %r", self.state_path, e, entry)
            # another server than last time: it may lack everything (remote_sync sends the rest)
            self.sweep_needed = bool(state.get("dirty", True)) or state.get("remote") != self.tier.url
            self.pushed_to = int(state.get("pushed_to", 0))
            if not 0 <= self.pushed_to <= OWN_CEILING:  # (no clock writes that: re-send everything)
                raise ValueError(f"pushed_to {self.pushed_to} out of range")
        except FileNotFoundError:
            self.sweep_needed = True  # never synced with a remote from this store: sweep once
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            _log.warning("%s unreadable (%s): re-sending every local object the remote lacks", self.state_path, e)
            self.pushed_to, self.sweep_needed = 0, True

    def start(self) -> None:
        """Begin sending what an earlier run left (once ``load`` and ``sweep_source`` are set).
        REMOTE says "dirty" from now until a clean ``close``: a put queued (or whose send
        failed) lives only in memory, so after a crash the next open must sweep."""
        self.save()
        if self._tombs or self.sweep_needed:
            self._wake()

    def save(self, *, clean: bool = False, last: bool = False) -> None:
        """Write REMOTE (atomically, one writer at a time): ``pushed_to``, the tombstones not yet
        sent, and whether a sweep is still owed.  After the ``last`` save (close) nothing more
        is written: a sender that outlived close's wait must not overwrite what the next open
        of the store saves."""
        if self.state_path is None:
            return
        with self._save_lock:
            if self._closed:
                return
            self._closed = last
            with self._cv:
                behind = self.sweep_needed or self.sweeping
                if not behind:
                    pushed = (min(self._pending) - 1) if self._pending else self.tier.clock.last
                    self.pushed_to = max(self.pushed_to, pushed)
                dirty = behind or bool(self._items) or not clean
                tombs = [[ns.hex(), k.hex(), v.stamp, v.origin.hex()] for (ns, k), v in self._tombs.items()]
                state = {"layout": fmt.REMOTE_LAYOUT, "remote": self.tier.url, "pushed_to": self.pushed_to,
                         "dirty": dirty, "tombstones": tombs}
            key = (state["pushed_to"], json.dumps(tombs), dirty)
            if key == self._saved:
                return
            write_state(self.state_path, json.dumps(state).encode())
            self._saved = key

    # -- producers ---------------------------------------------------------------------------

    def issue(self) -> int:
        """A stamp for a put about to be written; ``pushed_to`` stays below it until ``sent``."""
        with self._cv:
            stamp = self.tier.next_stamp()
            self._pending[stamp] += 1
            return stamp

    def _release(self, stamp: int) -> None:
        if stamp:
            self._pending[stamp] -= 1
            if self._pending[stamp] <= 0:
                del self._pending[stamp]

    def sent(self, stamp: int) -> None:
        """The put with this stamp reached the server (or will never be sent: it failed locally)."""
        with self._cv:
            self._release(stamp)

    def add(self, ns: bytes, k: bytes, stamp: int) -> None:
        """Queue the key's newest local version (``stamp`` stays pending until it is sent)."""
        with self._cv:
            key = (ns, k)
            old = self._items.pop(key, None)
            if old is not None:
                self._release(old.stamp)  # superseded by the newer put
            self._items[key] = Version(stamp, b"")
            self.tier.count("queued")
            while len(self._items) > self.limit:
                _, dropped = self._items.popitem(last=False)
                self._release(dropped.stamp)
                self.tier.count("queue_dropped")
                self.sweep_needed = True
            self._wake_locked()

    def add_tombstone(self, ns: bytes, k: bytes, version: Version) -> None:
        with self._cv:
            self._tombs[(ns, k)] = version
            old = self._items.pop((ns, k), None)
            if old is not None:
                self._release(old.stamp)
        self.save()  # survives a crash: a delete leaves nothing the log could re-send
        self._wake()

    @property
    def tombstones_pending(self) -> int:
        """Deletes not yet sent (kept in REMOTE)."""
        return len(self._tombs)

    def send_tombstones(self) -> tuple[int, int, int]:
        """Send every delete not yet sent, now (``remote_sync``): (sent, not sent: no answer,
        refused by the server: dropped, as the sender drops them).  The sender thread may send
        one at the same time: the compare-and-set makes that harmless."""
        with self._cv:
            todo = list(self._tombs.items())
        sent = failed = refused = 0
        for (ns, k), version in todo:
            try:
                held = self.tier.tombstone(ns, k, version)
            except RemoteRefused:  # (counted in the tier's stats, and logged by its first refusal)
                self.tier.count("refused")
                refused += 1
            except RemoteDown:
                failed += 1
                continue
            else:
                sent += held  # (False: the server holds a newer version, a conflict the tier counts)
            with self._cv:
                if self._tombs.get((ns, k)) == version:
                    del self._tombs[(ns, k)]
        if len(todo) > failed:
            self.save()
        return sent, failed, refused

    def tombstone_of(self, ns: bytes, k: bytes) -> Version | None:
        """The version of a delete of the key not yet sent, if any (reads treat it as local)."""
        return self._tombs.get((ns, k))

    def _wake(self) -> None:
        with self._cv:
            self._wake_locked()

    def _wake_locked(self) -> None:
        if self._thread is None and not self._stopping:
            self._thread = threading.Thread(target=self._run, name="tierstore-remote-push", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    # -- the sender ----------------------------------------------------------------------------

    def _work_left(self) -> bool:
        return bool(self._items or self._tombs or self.sweeping
                    or (self.sweep_needed and self.sweep_source is not None))

    def _run(self) -> None:
        tier = self.tier
        try:
            while True:
                with self._cv:
                    while not self._stopping and not self._work_left():
                        self._cv.wait()
                    if self._stopping:  # close() waited for the drain it allows: the rest waits in REMOTE
                        return
                if tier.down:
                    with self._cv:
                        self._cv.wait(max(0.01, tier.down_for))
                    continue
                try:
                    self._step()
                except (RemoteDown, TierstoreError, OSError) as e:  # down, refused (a full server), or
                    if not isinstance(e, RemoteDown):  # the local record unreadable: try again later
                        _log.warning("remote %s: a send failed: %s", tier.url, e)
                    with self._cv:
                        self.failures += 1
                        self._cv.notify_all()
                        if self._stopping:
                            return
                        self._cv.wait(tier.retry_s)
        finally:
            with self._cv:
                self._thread = None  # a later wake starts a new sender
                self._cv.notify_all()

    def _step(self) -> None:
        tier = self.tier
        with self._cv:
            tomb = next(iter(self._tombs.items()), None)
            item = None if tomb else next(iter(self._items.items()), None)
        if tomb is not None:
            (ns, k), version = tomb
            try:
                tier.tombstone(ns, k, version)
            except RemoteRefused:  # (counted and logged): retrying would block the keys behind it
                tier.count("refused")
            with self._cv:
                if self._tombs.get((ns, k)) == version:
                    del self._tombs[(ns, k)]
            self.save()
            return
        if item is not None:
            (ns, k), queued = item
            try:
                self._send(ns, k)
            except RemoteRefused:  # too large, a foreign key type: dropped (counted), not retried ahead
                tier.count("refused")  # of the keys behind it
            with self._cv:
                if self._items.get((ns, k)) is queued:
                    del self._items[(ns, k)]
                    self._release(queued.stamp)
            if not self._items:
                self.save()
            return
        if self.sweep_needed and self.sweep_source is not None:
            self.sweep()

    def _send(self, ns: bytes, k: bytes) -> None:
        assert self.load is not None
        got = self.load(ns, k)
        if got is not None:  # None: deleted meanwhile (its tombstone is queued) or not this store's
            record, version = got
            self.tier.push(record, version)

    def sweep(self) -> int:
        """Re-send every local object of this store newer than ``pushed_to`` (compare-and-set
        makes a repeat harmless); ``pushed_to`` does not move while it runs.  Returns how many
        were sent."""
        assert self.sweep_source is not None
        with self._cv:
            self.sweep_needed, self.sweeping = False, True
            floor = self.pushed_to
        sent = 0
        try:
            for ns, k, version in self.sweep_source():
                if self._stopping:
                    raise RemoteDown("closing")
                if version.stamp > floor and version.origin == self.tier.origin:
                    with self._cv:  # a put still in flight sends it itself (or queues it)
                        if version.stamp in self._pending:
                            continue
                    try:
                        self._send(ns, k)
                    except RemoteRefused:  # (too large, a foreign key type): not the others' end
                        self.tier.count("refused")
                        continue
                    sent += 1
                    self.tier.count("resent")
        except BaseException:
            with self._cv:
                self.sweep_needed, self.sweeping = True, False
            raise
        with self._cv:
            self.sweeping = False
        self.save()
        return sent

    def close(self, drain_s: float) -> None:
        """Wait (at most ``drain_s``) for the queue to drain, then stop the sender.  A send that
        failed before close gets one more try (one blip of the server does not leave a put
        unsent until the next open) if it comes within the wait; the first failure after close
        began ends the wait."""
        deadline = time.monotonic() + drain_s
        with self._cv:
            failures = self.failures
            while self._work_left() and self._thread is not None and time.monotonic() < deadline \
                    and self.failures == failures:
                if self.tier.down and time.monotonic() + self.tier.down_for >= deadline:
                    break  # the next try would come after the wait allowed
                self._cv.wait(0.05)
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:  # at most one send in flight, bounded by the client's timeouts
            thread.join(2 * self.tier.timeout + self.tier.connect_timeout + 1)
        self.save(clean=True, last=True)


TIMEOUT_MAX_S = 86400.0  # a remote timeout's largest (an infinite one overflowed the socket's clock in redis-py)


def check_settings(**settings: Any) -> None:
    """InvalidObject for a bad ``Remote`` setting (``policy``, ``timeout``, ``connect_timeout``,
    ``retry_s``, ``queue``: those given), named as ``tierstore.open``'s option."""
    if "policy" in settings and settings["policy"] not in POLICIES:
        raise InvalidObject(f"remote_policy must be one of {', '.join(POLICIES)}, got {settings['policy']!r}")
    for name in ("timeout", "connect_timeout", "retry_s"):
        if name not in settings:
            continue
        value, option = settings[name], "remote_" + name
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise InvalidObject(f"{option} must be a positive number of seconds, got {value!r}")
        if name != "retry_s" and not value <= TIMEOUT_MAX_S:
            raise InvalidObject(f"{option} must be at most {TIMEOUT_MAX_S:g} seconds (a day), got {value!r}")
    queue = settings.get("queue", 1)
    if isinstance(queue, bool) or not isinstance(queue, int) or queue < 1:
        raise InvalidObject(f"remote_queue must be a positive number of keys, got {queue!r}")
REMOTE_OPTIONS = ("remote", "remote_policy", "remote_timeout", "remote_connect_timeout", "remote_retry_s",
                  "remote_queue")


def remote_options(options: dict[str, Any]) -> dict[str, Any] | None:
    """Pop and check the remote tier's options of ``tierstore.open``; None without ``remote=``."""
    url = options.pop("remote", None)
    picked = {name: options.pop(name) for name in REMOTE_OPTIONS[1:] if name in options}
    if "remote_policy" in picked and picked["remote_policy"] not in POLICIES:  # (the value first: a typo)
        raise InvalidObject(f"remote_policy must be one of {', '.join(POLICIES)}, got {picked['remote_policy']!r}")
    if url is None:
        if picked:
            raise InvalidObject(f"{', '.join(picked)} given without remote= (the server's URL)")
        return None
    parse_url(url)  # checked before anything is opened
    out = {"url": url}
    for name, value in picked.items():
        out[{"remote_policy": "policy", "remote_timeout": "timeout", "remote_connect_timeout": "connect_timeout",
             "remote_retry_s": "retry_s", "remote_queue": "queue"}[name]] = value
    check_settings(**{k: v for k, v in out.items() if k != "url"})  # (before anything is opened, as the URL)
    return out
