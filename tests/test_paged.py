"""Paged KV buffers <-> stored chunk layers (tierstore/integrations/paged.py, the vLLM connector's
copies): every layout vLLM has handed connectors, NHD and HND memory, kernel blocks that split a
scheduler block, MLA latents, several dtypes; bit-exact both ways, and unknown layouts refused."""

from __future__ import annotations

import pytest

from .conftest import HAS_TORCH

pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed (optional extra)")

if HAS_TORCH:
    import torch

    from tierstore import InvalidObject
    from tierstore.integrations.paged import PagedLayout, gather, scatter

NB, BS, H, D = 40, 16, 4, 32


@pytest.fixture(autouse=True, params=["numba", "numpy"])
def copies(request, monkeypatch):
    """Every test runs twice: host copies by the loop numba compiles (a dev dependency: its absence
    fails these runs) and by numpy's copies (what runs without numba)."""
    from tierstore.integrations import paged

    if request.param == "numpy":
        monkeypatch.setattr(paged, "compiled_kernel", lambda: None)
    else:
        assert paged.compiled_kernel() is not None, "numba is a dev dependency: the compiled copies must be tested"
    return request.param


def make(form, mem, ratio, dtype):
    n = BS // ratio
    if form == "bhnc":  # vLLM 0.33: [blocks, heads, block_tokens, K|V]
        t = torch.randn(NB * ratio, n, H, 2 * D).permute(0, 2, 1, 3) if mem == "NHD" else \
            torch.randn(NB * ratio, H, n, 2 * D)
    elif form == "kv_first":
        t = torch.randn(2, NB, H, BS, D).permute(0, 1, 3, 2, 4) if mem == "HND" else torch.randn(2, NB, BS, H, D)
    else:
        t = torch.randn(NB, 2, H, BS, D).permute(0, 1, 3, 2, 4) if mem == "HND" else torch.randn(NB, 2, BS, H, D)
    return t.to(dtype)


def per_block(t, form):
    """Independent of paged.py: each kernel block as [2, heads, tokens, dim]."""
    if form == "bhnc":
        return torch.stack([torch.stack([t[b, :, :, :D], t[b, :, :, D:]]) for b in range(t.shape[0])])
    if form == "kv_first":
        return t.permute(1, 0, 3, 2, 4)
    return t.permute(0, 1, 3, 2, 4)


def same(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


CASES = [(f, m, r, d) for f in ("bhnc", "kv_first", "blocks_first") for m in ("NHD", "HND")
         for r in ((1, 2, 4) if f == "bhnc" else (1,)) for d in ("float16", "bfloat16", "float32", "float8_e4m3fn")]


@pytest.mark.parametrize("form,mem,ratio,dtype", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_gather_then_scatter_is_bit_exact(form, mem, ratio, dtype):
    t = make(form, mem, ratio, getattr(torch, dtype))
    lay = PagedLayout.of(t, num_blocks=NB, block_size=BS)
    assert (lay.kind, lay.form, lay.ratio, lay.heads, lay.dim) == ("kv", form, ratio, H, D)
    blocks = per_block(t, form)
    for ids in ([7, 3, 39], [10, 11, 12, 30, 31], [5, 4, 3]):  # scattered, runs of consecutive blocks, descending
        out = torch.empty(lay.chunk_shape(len(ids) * BS), dtype=t.dtype)
        gather(t, lay, ids, out)
        want = torch.cat([blocks[b * ratio + i] for b in ids for i in range(ratio)], dim=2)
        assert same(out, want)
    whole = torch.empty(lay.chunk_shape(3 * BS), dtype=t.dtype)
    back2 = torch.zeros_like(t)
    scatter(back2, lay, [20, 21, 22], gather(t, lay, [10, 11, 12], whole))  # a run both ways
    assert all(same(per_block(back2, form)[(20 + k) * ratio + i], blocks[(10 + k) * ratio + i])
               for k in range(3) for i in range(ratio))
    out = gather(t, lay, [7, 3, 39], torch.empty(lay.chunk_shape(3 * BS), dtype=t.dtype))
    back = torch.zeros_like(t)
    scatter(back, lay, [1, 2], out, positions=[2, 0])  # chunk block 2 -> pool block 1, 0 -> 2
    got = per_block(back, form)
    for i in range(ratio):
        assert same(got[1 * ratio + i], blocks[39 * ratio + i]) and same(got[2 * ratio + i], blocks[7 * ratio + i])
    untouched = [b for b in range(NB) if b not in (1, 2)]
    assert all(not got[b * ratio + i].view(torch.uint8).any() for b in untouched for i in range(ratio))


@pytest.mark.parametrize("mla", [False, True])
def test_gather_and_scatter_with_a_chunk_that_is_a_view_of_a_larger_tensor(mla):
    """The host path views the chunk as blocks with its own strides: a chunk layer that is a
    slice of a bigger tensor (tokens not contiguous with the next head's) is filled and read in
    place, and nothing around it is touched."""
    if mla:
        t = torch.randn(NB, BS, 64).half()
        lay = PagedLayout.of(t, num_blocks=NB, block_size=BS, mla=True)
        big = torch.zeros(5 * BS, 64).half()
        view = big[BS:4 * BS]
    else:
        t = make("bhnc", "NHD", 1, torch.float16)
        lay = PagedLayout.of(t, num_blocks=NB, block_size=BS)
        big = torch.zeros(2, H, 5 * BS, D).half()
        view = big[:, :, BS:4 * BS]
    assert not view.is_contiguous() or mla
    gather(t, lay, [7, 3, 39], view)
    want = gather(t, lay, [7, 3, 39], torch.empty(lay.chunk_shape(3 * BS), dtype=t.dtype))
    assert same(view, want)
    rest = big.clone()
    (rest[BS:4 * BS] if mla else rest[:, :, BS:4 * BS]).zero_()
    assert not rest.view(torch.uint8).any()  # outside the view: untouched
    back = torch.zeros_like(t)
    scatter(back, lay, [2, 4, 6], view)
    again = gather(back, lay, [2, 4, 6], torch.empty(lay.chunk_shape(3 * BS), dtype=t.dtype))
    assert same(again, want)


@pytest.mark.parametrize("form", ["bhnc", "bnc"])
def test_mla_latents(form):
    t = torch.randn(NB, 1, BS, 576).half() if form == "bhnc" else torch.randn(NB, BS, 576).half()
    lay = PagedLayout.of(t, num_blocks=NB, block_size=BS, mla=True)
    assert lay.kind == "mla" and lay.chunk_shape(32) == (32, 576)
    out = torch.empty(32, 576, dtype=torch.float16)
    gather(t, lay, [5, 9], out)
    flat = t[:, 0] if form == "bhnc" else t
    assert torch.equal(out, torch.cat([flat[5], flat[9]]))
    back = torch.zeros_like(t)
    scatter(back, lay, [9, 5], out)
    fb = back[:, 0] if form == "bhnc" else back
    assert torch.equal(fb[9], flat[5]) and torch.equal(fb[5], flat[9])


def test_unknown_layouts_and_bad_chunks_are_refused():
    with pytest.raises(InvalidObject, match="not a layout"):
        PagedLayout.of(torch.zeros(NB, 3, BS, H, D), num_blocks=NB, block_size=BS)
    with pytest.raises(InvalidObject, match="not a layout"):
        PagedLayout.of(torch.zeros(NB, H, BS, 2 * D), num_blocks=NB, block_size=BS, mla=True)  # H != 1
    t = make("bhnc", "NHD", 1, torch.float16)
    lay = PagedLayout.of(t, num_blocks=NB, block_size=BS)
    with pytest.raises(InvalidObject, match="expected"):
        gather(t, lay, [1, 2], torch.empty(2, H, BS, D, dtype=torch.float16))  # room for one block only
    with pytest.raises(InvalidObject, match="does not fit"):
        scatter(t, lay, [1], torch.empty(2, H, BS, D, dtype=torch.float16), positions=[1])
    valid = torch.randn(2, H, BS, D).half()  # the valid twin: the same call with a position that exists
    scatter(t, lay, [1], valid, positions=[0])
    assert torch.equal(per_block(t, "bhnc")[1], valid)
    before = t.clone()
    for bad in ([NB], [-1], [3, NB + 5]):  # block ids outside the pool: refused before any byte moves
        with pytest.raises(InvalidObject, match="outside the pool"):
            scatter(t, lay, [0] * (len(bad) - 1) + bad[-1:], torch.randn(2, H, len(bad) * BS, D).half())
        with pytest.raises(InvalidObject, match="outside the pool"):
            gather(t, lay, bad, torch.empty(2, H, len(bad) * BS, D, dtype=torch.float16))
    assert torch.equal(t, before)
    gather(t, lay, [NB - 1], torch.empty(2, H, BS, D, dtype=torch.float16))  # the last block exists


@pytest.mark.parametrize("form,mem,ratio", [("bhnc", "NHD", 1), ("bhnc", "HND", 2), ("kv_first", "NHD", 1),
                                            ("blocks_first", "HND", 1)])
def test_the_device_path_gives_the_same_bytes(form, mem, ratio):
    """The torch path (what a CUDA layer takes: one index_select / index_copy_ per copy), run on
    CPU tensors here, against the numpy path."""
    from tierstore.integrations.paged import PagedLayer

    t = make(form, mem, ratio, torch.float16)
    lay = PagedLayout.of(t, num_blocks=NB, block_size=BS)
    host = PagedLayer(t, lay)
    ids = [7, 3, 39, 8]
    want = host.gather(ids, torch.empty(lay.chunk_shape(4 * BS), dtype=t.dtype))
    got = torch.empty_like(want)
    host._copy_torch(got, list(enumerate(lay.kernel_blocks(ids))), to_chunk=True)
    assert torch.equal(got, want)
    a, b = torch.zeros_like(t), torch.zeros_like(t)
    PagedLayer(a, lay).scatter([1, 2], want, positions=[3, 0])
    r = lay.ratio
    PagedLayer(b, lay)._copy_torch(want, [(p * r + i, q * r + i) for p, q in ((3, 1), (0, 2)) for i in range(r)],
                                   to_chunk=False)
    assert torch.equal(a, b) and a.any()


def test_mla_device_path():
    from tierstore.integrations.paged import PagedLayer

    t = torch.randn(NB, 1, BS, 64).half()
    lay = PagedLayout.of(t, num_blocks=NB, block_size=BS, mla=True)
    want = PagedLayer(t, lay).gather([4, 2], torch.empty(32, 64, dtype=torch.float16))
    got = torch.empty_like(want)
    PagedLayer(t, lay)._copy_torch(got, [(0, 4), (1, 2)], to_chunk=True)
    assert torch.equal(got, want)
    a = torch.zeros_like(t)
    PagedLayer(a, lay)._copy_torch(want, [(1, 9)], to_chunk=False)
    assert torch.equal(a[9, 0], t[2, 0])


def test_a_layout_read_from_another_layer_is_refused_before_any_copy():
    """A PagedLayout of 4-token blocks over a pool of 16-token blocks (or the other way round):
    the compiled loop, which checks no index, wrote past the chunk with it; both paths refuse it
    when the layer is made.  Its twin: the layout read from the layer itself."""
    from tierstore.integrations.paged import PagedLayer

    t16 = make("kv_first", "NHD", 1, torch.float16)
    small = PagedLayout("kv", "kv_first", 1, 4, H, D)
    with pytest.raises(InvalidObject, match="not laid out"):
        PagedLayer(t16, small)
    t4 = torch.randn(2, NB, 4, H, D).half()
    with pytest.raises(InvalidObject, match="not laid out"):
        PagedLayer(t4, PagedLayout.of(t16, num_blocks=NB, block_size=BS))
    bhnc = make("bhnc", "NHD", 1, torch.float16)
    with pytest.raises(InvalidObject, match="not laid out"):  # another head_dim: torch cannot even view it
        PagedLayer(bhnc, PagedLayout("kv", "bhnc", 1, BS, H, 3 * D))
    with pytest.raises(InvalidObject, match="not laid out"):  # a tensor of another rank
        PagedLayer(torch.zeros(NB, BS, 64).half(), PagedLayout("kv", "bhnc", 1, BS, H, D))
    lay = PagedLayout.of(t16, num_blocks=NB, block_size=BS)
    out = PagedLayer(t16, lay).gather([3], torch.empty(lay.chunk_shape(BS), dtype=t16.dtype))
    assert same(out, per_block(t16, "kv_first")[3])
