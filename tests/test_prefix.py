"""Prefix reuse: chunk hashes (SPEC.md §13), match_prefix, and namespace-scoped handles."""

from __future__ import annotations

import hashlib
import itertools
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierstore
from tierstore import Blob, chunk_hashes

from .conftest import HAS_TORCH

TOKENS = st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=300)


def spec_hashes(tokens: list[int], chunk: int, salt: bytes, partial: bool = False) -> list[bytes]:
    """SPEC.md §13 written out again, independently of tierstore.prefix."""
    out, parent = [], bytes(32)
    n = len(tokens) if partial else len(tokens) // chunk * chunk
    for start in range(0, n, chunk):
        part = tokens[start : min(start + chunk, n)]
        parent = hashlib.sha256(b"tierstore/chunk/v1" + struct.pack("<I", len(salt)) + salt + parent
                                + struct.pack("<I", len(part)) + struct.pack(f"<{len(part)}I", *part)).digest()
        out.append(parent)
    return out


# SPEC.md §13 worked example: tokens 0..7, chunk_tokens=4, salt "llama3-8b/tp1".  Pinned bytes:
# a change of encoding fails here (and breaks every key other engines computed).
KNOWN = ["8e1c834157d5de6072819bb3948721d96691e45730bb65301ed546a7a9c12b14",
         "4f993444669684e719cfbff503241018c7f71f4357b3ebfd3b3e2614a152d640"]


def test_known_answer():
    """Stable across processes, machines and versions: these bytes never change."""
    hashes = chunk_hashes(list(range(8)), chunk_tokens=4, salt="llama3-8b/tp1")
    assert [h.hex() for h in hashes] == KNOWN
    assert [h.hex() for h in spec_hashes(list(range(8)), 4, b"llama3-8b/tp1")] == KNOWN


@settings(max_examples=200, deadline=None)
@given(tokens=TOKENS, chunk=st.integers(1, 64), salt=st.binary(max_size=20), partial=st.booleans())
def test_hashes_follow_the_spec(tokens, chunk, salt, partial):
    assert chunk_hashes(tokens, chunk_tokens=chunk, salt=salt, include_partial=partial) == \
        spec_hashes(tokens, chunk, salt, partial)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 50000), min_size=1, max_size=300), chunk=st.integers(1, 64),
       data=st.data())
def test_one_changed_token_changes_its_chunk_and_every_later_one(tokens, chunk, data):
    i = data.draw(st.integers(0, len(tokens) - 1))
    other = list(tokens)
    other[i] = (other[i] + data.draw(st.integers(1, 1000))) % 50001
    a = chunk_hashes(tokens, chunk_tokens=chunk, include_partial=True)
    b = chunk_hashes(other, chunk_tokens=chunk, include_partial=True)
    c = i // chunk
    assert a[:c] == b[:c]  # equal prefixes, equal hashes
    assert all(x != y for x, y in zip(a[c:], b[c:]))
    extended = chunk_hashes(tokens + [1, 2, 3], chunk_tokens=chunk)
    assert extended[: len(tokens) // chunk] == a[: len(tokens) // chunk]  # a longer context shares the prefix


def test_salt_and_partial_chunks():
    toks = list(range(10))
    assert len(chunk_hashes(toks, chunk_tokens=4)) == 2
    assert len(chunk_hashes(toks, chunk_tokens=4, include_partial=True)) == 3
    assert chunk_hashes(toks, chunk_tokens=4, salt="a") != chunk_hashes(toks, chunk_tokens=4, salt="b")
    assert chunk_hashes(toks, chunk_tokens=4, salt="a") == chunk_hashes(toks, chunk_tokens=4, salt=b"a")
    # a partial chunk never equals the full chunk that starts with the same tokens
    assert chunk_hashes(toks[:6], chunk_tokens=4, include_partial=True)[1] != \
        chunk_hashes(toks[:8], chunk_tokens=4)[1]
    assert chunk_hashes([], chunk_tokens=4) == []


def test_token_containers_agree():
    toks = [1, 70000, 2**32 - 1, 0] * 5
    want = chunk_hashes(toks, chunk_tokens=4)
    assert chunk_hashes(np.array(toks, dtype=np.int64), chunk_tokens=4) == want
    assert chunk_hashes(np.array(toks, dtype=np.uint32), chunk_tokens=4) == want
    assert chunk_hashes(tuple(toks), chunk_tokens=4) == want
    if HAS_TORCH:
        import torch
        assert chunk_hashes(torch.tensor(toks, dtype=torch.int64), chunk_tokens=4) == want


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], [True], [[1, 2]], "abc", np.zeros((2, 2), dtype=np.int32)])
def test_bad_tokens_are_rejected(bad):
    with pytest.raises(tierstore.InvalidObject):
        chunk_hashes(bad, chunk_tokens=1)


@pytest.mark.parametrize("chunk", [0, -1, 1.0, None])
def test_bad_chunk_size_is_rejected(chunk):
    with pytest.raises(tierstore.InvalidObject):
        chunk_hashes([1, 2], chunk_tokens=chunk)


# -- match_prefix ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefix_store(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("prefix") / "store")
    with tierstore.open(path, durability="group", index_commit_ms=1e9, index_batch=10**9) as s:
        yield s


_FRESH = itertools.count()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stored=st.lists(st.booleans(), min_size=0, max_size=40), query_len=st.integers(0, 45),
       flush=st.booleans(), data=st.data())
def test_match_prefix_is_exact_on_random_stores(prefix_store, stored, query_len, flush, data):
    s = prefix_store
    ns = f"m{next(_FRESH)}"  # a fresh namespace per example: the store is shared
    hashes = chunk_hashes(list(range(query_len * 2)), chunk_tokens=2, salt=ns)
    for h, keep in zip(hashes, stored):
        if keep:
            s.put(h, Blob(h), namespace=ns)
    deleted = data.draw(st.integers(0, max(0, len(hashes) - 1))) if hashes and data.draw(st.booleans()) else None
    if deleted is not None and s.contains(hashes[deleted], namespace=ns):
        s.delete(hashes[deleted], namespace=ns)
    if flush:
        s.flush()  # from the index, else from the memtable
    want = 0
    while want < len(hashes) and want < len(stored) and stored[want] and want != deleted:
        want += 1
    assert s.match_prefix(hashes, namespace=ns) == want
    assert s.match_prefix(hashes, namespace=ns + "-other") == 0  # namespaces never mix


def test_match_prefix_after_reopen(store_path):
    hashes = chunk_hashes(list(range(64)), chunk_tokens=8)
    with tierstore.open(store_path) as s:
        for h in hashes[:5]:
            s.put(h, Blob(b"kv"), namespace="m")
        assert s.match_prefix(hashes, namespace="m") == 5
    with tierstore.open(store_path, readonly=True) as s:
        assert s.match_prefix(hashes, namespace="m") == 5
        assert s.match_prefix([], namespace="m") == 0
        with pytest.raises(tierstore.InvalidObject):
            s.match_prefix([b""], namespace="m")


# -- namespace-scoped handles ---------------------------------------------------------------------------


def test_a_tenant_handle_cannot_reach_another_tenants_keys(store_path):
    with tierstore.open(store_path) as s:
        s.put(b"k", Blob(b"system prompt"), namespace="system")
        a = s.namespace("tenant-a", shared=["system"])
        b = s.namespace("tenant-b", shared=["system"])
        a.put(b"k", Blob(b"a's"))
        b.put(b"k", Blob(b"b's"), session="s1")
        assert a.get(b"k").data == b"a's" and b.get(b"k").data == b"b's"  # same key, never mixed
        for call in (lambda: a.get(b"k", namespace="tenant-b"), lambda: a.contains(b"k", namespace="tenant-b"),
                     lambda: a.keys(namespace="tenant-b"), lambda: a.info(b"k", namespace="tenant-b"),
                     lambda: a.match_prefix([b"k"], namespace="tenant-b"), lambda: a.keys(namespace="default")):
            with pytest.raises(tierstore.AccessDenied):
                call()
        with pytest.raises(tierstore.AccessDenied):
            a.put(b"k", Blob(b"x"), namespace="tenant-b")  # writes go to the handle's own namespace only
        with pytest.raises(tierstore.AccessDenied):
            a.delete(b"k", namespace="tenant-b")
        assert a.drop_session("s1") == 0  # a's drop cannot touch b's session
        assert b.get(b"k").data == b"b's" and b.session_keys("s1") == [b"k"] and a.session_keys("s1") == []
        # the shared namespace: readable by both, writable by neither
        assert a.get(b"k", namespace="system").data == b"system prompt"
        assert b.match_prefix([b"k"], namespace="system") == 1
        assert a.keys() == [b"k"] and a.keys(namespace="system") == [b"k"]
        ro = s.namespace("system", readonly=True)
        with pytest.raises(tierstore.ReadOnlyError):
            ro.put(b"k", Blob(b"overwritten"))
        with pytest.raises(tierstore.ReadOnlyError):
            ro.delete(b"k")
        assert s.get(b"k", namespace="system").data == b"system prompt"
        with pytest.raises(tierstore.InvalidObject):
            s.namespace("../tenant-b")
        with pytest.raises(tierstore.InvalidObject):
            s.namespace("tenant-a", shared=["a\x00b"])
