"""Triton kernels vs their PyTorch references (dsv4_backend/kernels/reference.py).

On a machine without a GPU the kernels run under TRITON_INTERPRET=1 (set here, before triton is
imported by the kernel modules), at tiny shapes. Every case draws fresh random inputs, poisons
outputs (NaN rows, pools full of random bytes) so that unwritten or stray writes show. Number
formats are compared bit for bit (quantising given values is order-free); everything a float32
sum feeds is compared within the bounds of tests/bounds.py, derived from the sizes summed: the
interpreter sums through numpy, whose order depends on the CPU, and the GPU in its own order.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bounds import (  # noqa: E402
    U32, assert_indexer_pools_close, assert_kv_pools_close, assert_within, attention_bound,
    compress_bounds, gamma, indexer_score_bound, norm_rope_bound, softmax_pool_bound,
)
from dsv4_backend.kernels import reference as R  # noqa: E402
from dsv4_backend.kernels._common import (  # noqa: E402
    bf16_bits, e4m3_decode, e4m3_encode, native, pow2_scale_exp, round_bf16,
)
from dsv4_backend.kernels.compressor import CompressEvents, compress, online_c128_update, ring_write  # noqa: E402
from dsv4_backend.kernels.indexer import IndexerConfig, indexer_topk  # noqa: E402
from dsv4_backend.kernels.kv_store import kv_store  # noqa: E402
from dsv4_backend.kernels.sparse_attention import DecodeAttentionConfig, sparse_decode  # noqa: E402
from memory.layout import read_indexer_rows, read_kv_rows, write_indexer_rows, write_kv_rows  # noqa: E402
from memory.quant import indexer_fake_quant, pow2_scale  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _poisoned_pool(pages, page_bytes, g):
    return torch.randint(0, 256, (pages, page_bytes), generator=g, dtype=torch.uint8).to(DEV)


def _cos_sin(n, g, theta=160000.0):
    pos = torch.randint(0, 1 << 20, (n,), generator=g)
    inv = theta ** (-torch.arange(32, dtype=torch.float32) * 2 / 64)
    ang = pos.float()[:, None] * inv
    return ang.cos().to(DEV), ang.sin().to(DEV)


def assert_rows_are_stored(out, pool, slots, what, indexer=False):
    """The dequantised rows a kernel returns are exactly the rows it stored (decoding is exact)."""
    keep = slots >= 0
    read = read_indexer_rows if indexer else read_kv_rows
    stored = read(pool.cpu(), slots[keep].long().cpu())
    assert torch.equal(out[keep].cpu(), stored), f"{what}: returned rows differ from the stored rows"


# ---- number-format helpers ------------------------------------------------------------------

@triton.jit
def _formats_kernel(x_ptr, codes_ptr, dec_ptr, bf_ptr, bfbits_ptr, k_ptr, N: tl.constexpr,
                    NATIVE: tl.constexpr):
    o = tl.arange(0, N)
    x = tl.load(x_ptr + o)
    codes = e4m3_encode(tl.minimum(tl.maximum(x, -448.0), 448.0), NATIVE)
    tl.store(codes_ptr + o, codes)
    tl.store(dec_ptr + o, e4m3_decode(codes, NATIVE))
    tl.store(bf_ptr + o, round_bf16(x, NATIVE))
    tl.store(bfbits_ptr + o, bf16_bits(x, NATIVE))
    tl.store(k_ptr + o, pow2_scale_exp(tl.abs(x)))


def test_number_formats_match_torch():
    g = _gen(1)
    n = 4096
    every_code = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    every_code = every_code[torch.isfinite(every_code)]
    mids = (every_code.sort().values[1:] + every_code.sort().values[:-1]) / 2  # exact ties
    rand = torch.randn(n, generator=g) * torch.exp2(torch.randint(-14, 10, (n,), generator=g).float())
    bf_ties = (torch.randn(64, generator=g).bfloat16().float().view(torch.int32) | 0x8000).view(torch.float32)
    x = torch.cat([every_code, mids, bf_ties, rand, torch.tensor([1e-5, 448.0, 449.0, 224.0])])
    x = x[:n]
    x = torch.cat([x, torch.randn(n - x.numel(), generator=g)]).contiguous().to(DEV)
    codes = torch.empty(n, dtype=torch.uint8, device=DEV)
    dec, bf = torch.empty(n, device=DEV), torch.empty(n, device=DEV)
    bfbits, k = torch.empty(n, dtype=torch.int32, device=DEV), torch.empty(n, dtype=torch.int32, device=DEV)
    _formats_kernel[(1,)](x, codes, dec, bf, bfbits, k, N=n, NATIVE=native())
    ref_codes = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(codes, ref_codes.view(torch.uint8))
    assert torch.equal(dec, ref_codes.float())
    assert torch.equal(bf, x.bfloat16().float())
    assert torch.equal(bfbits, x.bfloat16().view(torch.int16).int() & 0xFFFF)
    assert torch.equal(k, pow2_scale(x.abs()).exponent.int())


# ---- 1. KV store ---------------------------------------------------------------------------

@pytest.mark.parametrize("round_bf16", [True, False])
def test_kv_store(round_bf16):
    g = _gen(2 + round_bf16)
    n = 6
    pool = _poisoned_pool(3, 128 * 584, g)
    ref_pool = pool.clone()
    kv = (torch.randn(n, 512, generator=g) * 4).to(DEV)
    kv[1, :64] *= 1e-6  # a near-zero tile: amax floor
    w = (torch.rand(512, generator=g) + 0.5).to(DEV)
    cos, sin = _cos_sin(n, g)
    slots = torch.tensor([0, 127, 128, -1, 383, 200]).to(DEV)
    out = torch.full((n, 512), float("nan"), device=DEV)
    kv_store(pool, slots, kv, w, cos, sin, round_bf16=round_bf16, out=out)
    R.kv_store_ref(ref_pool, slots, kv, w, cos, sin, round_bf16=round_bf16)
    keep = slots >= 0
    pre = norm_rope_bound(kv[keep], 0.0, w, bf16_mid=round_bf16)
    assert_kv_pools_close(pool, ref_pool, slots[keep], pre, "SWA pool")
    assert torch.isnan(out[~keep]).all(), "a skipped row was written"
    assert_rows_are_stored(out, pool, slots, "rows")


# ---- 2. compressor -------------------------------------------------------------------------

@pytest.mark.parametrize("ratio,indexer,state_dtype", [
    (4, False, torch.float32), (4, True, torch.float32), (128, False, torch.bfloat16)])
def test_compress(ratio, indexer, state_dtype):
    g = _gen(10 + ratio + indexer)
    d = 128 if indexer else 512
    coff = 2 if ratio == 4 else 1
    k = coff * ratio
    e = 3
    state = (torch.randn(200, 2 * coff * d, generator=g) * 2).to(state_dtype).to(DEV)
    ape = torch.randn(ratio, coff * d, generator=g).to(DEV)
    src = torch.randint(0, 200, (e, k), generator=g)
    if ratio == 4:
        src[0, :4] = -1  # the first block has no previous block
    src = src.to(DEV)
    dest = torch.tensor([5, 64, 127]).to(DEV)
    w = (torch.rand(d, generator=g) + 0.5).to(DEV)
    cos, sin = _cos_sin(e, g)
    row_bytes = 132 if indexer else 584
    pool = _poisoned_pool(2, 64 * row_bytes, g)
    ref_pool = pool.clone()
    had = R.hadamard_matrix(128, device=DEV) if indexer else None
    out = torch.full((e, d), float("nan"), device=DEV)
    compress(pool, CompressEvents(dest, src, cos, sin), state, ape, w, ratio, hadamard=had, out=out)
    R.compress_ref(ref_pool, dest, state, src, ape, w, cos, sin, ratio, indexer=indexer)
    pre = compress_bounds(state, src, ape, w, ratio, d, indexer)
    close = assert_indexer_pools_close if indexer else assert_kv_pools_close
    close(pool, ref_pool, dest, pre, "compressed pool")
    assert_rows_are_stored(out, pool, dest, "rows", indexer)


@pytest.mark.parametrize("ring_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gather", [False, True])
def test_ring_write_is_cat_gather_index_put(ring_dtype, gather):
    """ring_write equals the torch ops it replaces bit for bit (the casts round to nearest even),
    from column views of one stacked projection, leaving every other slot untouched."""
    gen = torch.Generator().manual_seed(3)
    T, n = 5, 96
    y = torch.randn(T, 3 * n, generator=gen) * 7
    c, z = y[:, :n], y[:, 2 * n:]
    ring = torch.randn(12, 2 * n, generator=gen).to(ring_dtype)
    want = ring.clone()
    tokens = torch.tensor([4, 0, 2]) if gather else None
    slots = torch.tensor([7, 1, 10]) if gather else torch.tensor([3, 9, 0, 11, 5])
    cz = torch.cat([c, z], dim=-1).to(ring_dtype)
    want[slots] = cz[tokens] if gather else cz
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    got = dev(ring)
    ring_write(got, dev(slots), dev(y)[:, :n], dev(y)[:, 2 * n:], dev(tokens))
    bits = (lambda t: t.view(torch.int16)) if ring_dtype == torch.bfloat16 else (lambda t: t)
    assert torch.equal(bits(got.cpu()), bits(want))
    with pytest.raises(ValueError, match="slots"):
        ring_write(got, dev(slots[:2]), dev(c), dev(z), dev(tokens))


@pytest.mark.parametrize("ring_dtype, na, nb", [(torch.float32, 96, 32), (torch.bfloat16, 96, 32),
                                                 (torch.float32, 1100, 40)])   # two column blocks of ring a
def test_ring_write_pair_is_two_ring_writes(ring_dtype, na, nb):
    """A CSA layer's two rings written in one launch: the bytes of two ring_write launches."""
    from dsv4_backend.kernels.compressor import ring_write_pair
    gen = torch.Generator().manual_seed(4)
    dev = lambda t: t.to(DEV)  # noqa: E731
    ya, yb = torch.randn(3, 2 * na, generator=gen) * 5, torch.randn(3, 2 * nb, generator=gen) * 5
    ra, rb = torch.randn(9, 2 * na, generator=gen).to(ring_dtype), torch.randn(9, 2 * nb, generator=gen).to(ring_dtype)
    slots, tokens = torch.tensor([6, 0, 3]), torch.tensor([2, 0, 1])
    want_a, want_b, got_a, got_b = dev(ra), dev(rb), dev(ra), dev(rb)
    ring_write(want_a, dev(slots), dev(ya)[:, :na], dev(ya)[:, na:], dev(tokens))
    ring_write(want_b, dev(slots), dev(yb)[:, :nb], dev(yb)[:, nb:], dev(tokens))
    ring_write_pair((got_a, got_b), dev(slots), (dev(ya)[:, :na], dev(yb)[:, :nb]), (dev(ya)[:, na:], dev(yb)[:, nb:]),
                    dev(tokens))
    bits = (lambda t: t.view(torch.int16)) if ring_dtype == torch.bfloat16 else (lambda t: t)
    assert torch.equal(bits(got_a), bits(want_a)) and torch.equal(bits(got_b), bits(want_b))
    with pytest.raises(ValueError, match="one dtype"):
        ring_write_pair((got_a, got_b.float() if ring_dtype == torch.bfloat16 else got_b.bfloat16()), dev(slots),
                        (dev(ya)[:, :na], dev(yb)[:, :nb]), (dev(ya)[:, na:], dev(yb)[:, nb:]), dev(tokens))


def test_compress_c4_pair_is_two_fused_launches():
    """Both C4 compressors of a CSA layer over one event list in one launch: the pools the two
    compress launches write, byte for byte (each program runs its own launch's code), masked events
    (dest -1, as in a decode graph) writing nothing."""
    from dsv4_backend.kernels.compressor import C4Target, compress_c4_pair
    g = _gen(21)
    e = 4
    src = torch.randint(0, 50, (e, 8), generator=g)
    src[0, :4] = -1
    events = CompressEvents(torch.tensor([5, -1, 70, 127]).to(DEV), src.to(DEV), *_cos_sin(e, g))
    targets = []
    for d, row_bytes in ((512, 584), (128, 132)):
        state = (torch.randn(50, 4 * d, generator=g) * 2).to(DEV)
        ape = torch.randn(4, 2 * d, generator=g).to(DEV)
        w = (torch.rand(d, generator=g) + 0.5).to(DEV)
        targets.append(C4Target(_poisoned_pool(2, 64 * row_bytes, g), state, ape, w,
                                R.hadamard_matrix(128, device=DEV) if d == 128 else None))
    want = [t.pool.clone() for t in targets]
    for t, pool in zip(targets, want):
        compress(pool, events, t.state, t.ape, t.norm_weight, 4, hadamard=t.hadamard)
    compress_c4_pair(*targets, events)
    for t, pool in zip(targets, want):
        assert torch.equal(t.pool, pool)
    with pytest.raises(ValueError, match="Hadamard"):
        compress_c4_pair(targets[1], targets[0], events)


def test_online_c128_matches_ring_pooling():
    g = _gen(20)
    d = 128
    ape = torch.randn(128, d, generator=g).to(DEV)
    # two requests: A runs positions 100..299 (completes blocks 0 and 1, restarts at 128, 256),
    # B positions 0..129 (a whole block from a fresh state, then a new block)
    pos_a, pos_b = torch.arange(100, 300), torch.arange(0, 130)
    cz = torch.randn(pos_a.numel() + pos_b.numel(), 2 * d, generator=g).to(DEV)
    positions = torch.cat([pos_a, pos_b]).to(DEV)
    state = torch.randn(4, 3, d, generator=g).to(DEV)  # slot 1's garbage must be reset at pos 128
    prefix = torch.randn(100, 2 * d, generator=g).to(DEV)  # A's tokens 0..99, folded in first
    online_c128_update(state, torch.tensor([1]).to(DEV), torch.tensor([0]).to(DEV),
                       torch.tensor([100]).to(DEV), prefix, torch.arange(100).to(DEV), ape)
    pooled = torch.full((cz.shape[0], d), float("nan"), device=DEV)
    online_c128_update(state, torch.tensor([1, 3]).to(DEV), torch.tensor([0, 200]).to(DEV),
                       torch.tensor([200, 130]).to(DEV), cz, positions, ape, pooled=pooled)
    all_a = torch.cat([prefix, cz[:200]])

    def check_state(got, tokens, positions, what):
        # the running max is one rounded add away from the inputs: exact; the sum and the
        # accumulator carry one rescale per token (2u) on top of their n-term sums
        want = R.online_c128_ref(tokens, positions, ape)
        with_abs = R.online_c128_ref(torch.cat([tokens[:, :d].abs(), tokens[:, d:]], 1), positions, ape)
        n = int((positions % 128).max()) + 1
        rel = gamma(n) + (2 * n + 4) * U32
        assert torch.equal(got[0].cpu(), want[0]), f"{what}: running max"
        assert_within(got[1], want[1], rel * want[1], f"{what}: sum")
        assert_within(got[2], want[2], rel * with_abs[2], f"{what}: acc")

    check_state(state[1], all_a, torch.arange(300), "state A")
    check_state(state[3], cz[200:], pos_b, "state B")
    ring = torch.cat([all_a[:256], cz[200:328]])  # the three completed blocks' tokens
    blocks = torch.arange(384).view(3, 128).to(DEV)
    ref = R.compress_pool_ref(ring, blocks, ape, 128, d)
    bound = softmax_pool_bound(*R.compress_candidates_ref(ring.cpu(), blocks.cpu(), ape.cpu(), 128, d))
    assert_within(pooled[[27, 155, 327]], ref, bound, "pooled A blocks 0, 1 and pooled B")
    done = torch.zeros(cz.shape[0], dtype=torch.bool)
    done[[27, 155, 327]] = True
    assert torch.isnan(pooled[~done]).all(), "pooled rows written at tokens that complete no block"


# ---- 3. indexer ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["table_tma", "table_tma_chunked", "table_tma_grouped", "table_pointers", "rows",
                                  "table_tma_f16", "rows_f16"])
def test_indexer_topk(mode):
    """Page-table lists through the bulk-copy kernel (one program per request, or one per page)
    and through the pointer kernel; explicit row lists through the pointer kernel; both with
    the fp16 products (q over its power-of-two scale), which give the bf16 products' scores."""
    use_table = not mode.startswith("rows")
    f16 = mode.endswith("_f16")
    cfg = IndexerConfig(tma=mode.startswith("table_tma"), chunk=64 if mode.endswith("chunked") else None,
                        group=None if mode.endswith("grouped") else 1,  # None: 4 for these bf16 products
                        products="f16" if f16 else "bf16")
    g = _gen(30 + use_table)
    b, h, k, p = 4, 8, 16, 64
    q = indexer_fake_quant(torch.randn(b, h, 128, generator=g))
    w = torch.randn(b, h, generator=g)
    pool = torch.zeros(8, p * 132, dtype=torch.uint8)
    rows = torch.randn(8 * p, 128, generator=g)
    # three identical rows that score high for request 0: ties go to the lower list position
    rows[[3 * p + 5, 3 * p + 10, 3 * p + 40]] = 6 * q[0, w[0].argmax()]
    write_indexer_rows(pool, torch.arange(8 * p), rows)
    pool, q, w = pool.to(DEV), q.to(DEV), w.to(DEV)
    table = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(b)])
    table[0, 0] = 3
    nvis = torch.tensor([250, 11, 0, 256])
    L = 4 * p
    pos = torch.arange(L)
    row_ids = table.gather(1, (pos // p)[None].expand(b, L)) * p + pos % p
    row_ids = row_ids.masked_fill(pos[None] >= nvis[:, None], -1).to(DEV)
    if use_table:
        got = indexer_topk(q, w, pool, k, page_table=table.to(DEV), num_visible=nvis.to(DEV), config=cfg)
    else:
        got = indexer_topk(q, w, pool, k, row_ids=row_ids, config=cfg)
    ref_scores = R.indexer_scores_ref(q, w, pool, row_ids)
    # q and the e4m3 rows are exact in bf16, so the GPU's bf16 products are exact too
    keys = read_indexer_rows(pool.cpu(), row_ids.clamp_min(0).long().cpu())
    assert_within(got.scores, ref_scores, indexer_score_bound(q, w, keys), "scores")
    if f16:   # q / 2^k and w 2^k with 2^k a power of two: every product and sum scales exactly
        bf16 = cfg._replace(products="bf16")
        same = (indexer_topk(q, w, pool, k, page_table=table.to(DEV), num_visible=nvis.to(DEV), config=bf16)
                if use_table else indexer_topk(q, w, pool, k, row_ids=row_ids, config=bf16))
        assert torch.equal(got.scores, same.scores) and torch.equal(got.rows, same.rows)
    # select on the kernel's own scores: the selection rule is what is under test here
    ref_top = R.topk_ref(got.scores, row_ids, k)
    assert torch.equal(got.rows.cpu(), ref_top.rows.cpu())
    assert (got.rows[1, 11:] == -1).all() and (got.rows[2] == -1).all()
    tie = got.scores[0, [5, 10, 40]]
    assert tie[0] == tie[1] == tie[2]
    chosen = got.rows[0].tolist()
    assert chosen.index(3 * p + 5) < chosen.index(3 * p + 10) < chosen.index(3 * p + 40)


# ---- 4. sparse decode attention -----------------------------------------------------------

def _check_attention(got, ref, q, swa, win, extra, ext, sink, scale, live=slice(None)):
    """out and lse within attention_bound: float32 sums in any order; on the GPU the weights
    meet the values in bf16 and out is stored in bf16."""
    keys, valid = read_kv_rows(swa.cpu(), win.clamp_min(0).long().cpu()), (win >= 0).cpu()
    if extra is not None:
        keys = torch.cat([keys, read_kv_rows(extra.cpu(), ext.clamp_min(0).long().cpu())], 1)
        valid = torch.cat([valid, (ext >= 0).cpu()], 1)
    gpu = q.is_cuda
    out_b, lse_b = attention_bound(q.float()[live], keys[live], valid[live], sink, scale,
                                   bf16_p=gpu, bf16_out=gpu and got.out.dtype == torch.bfloat16)
    assert_within(got.out[live], ref.out[live], out_b, "out")
    assert_within(got.lse[live], ref.lse[live], lse_b, "lse")


def _kv_pool(pages, page_rows, g):
    pool = torch.zeros(pages, page_rows * 584, dtype=torch.uint8)
    n = pages * page_rows
    write_kv_rows(pool, torch.arange(n), torch.randn(n, 512, generator=g) * 2)
    return pool.to(DEV)


@pytest.mark.parametrize("h,k,num_splits,scales,halves", [
    (8, 48, 1, "element", False), (16, 130, 3, "word", True), (20, 70, None, "element", True),
    (16, 40, 2, "word", False), (16, 40, 1, "word", True)])
def test_sparse_decode(h, k, num_splits, scales, halves):
    g = _gen(40 + h)
    b, w_len = 3, 128
    swa = _kv_pool(4, 128, g)
    extra = _kv_pool(6, 64, g)
    win = torch.randint(0, 512, (b, w_len), generator=g)
    win[0, 90:] = -1  # a short window
    ext = torch.randint(0, 384, (b, k), generator=g)
    ext[0, ::3] = -1  # holes in the extra list
    win[2], ext[2] = -1, -1  # a request with no key at all
    q = torch.randn(b, h, 512, generator=g) * 3
    sink = torch.randn(h, generator=g)
    scale = 512 ** -0.5
    qd = q.to(DEV).to(torch.bfloat16 if DEV == "cuda" else torch.float32)
    out = torch.full((b, h, 512), float("nan"), device=DEV, dtype=qd.dtype)
    cfg = DecodeAttentionConfig(block_n=32, scales=scales, halves=halves)
    got = sparse_decode(qd, swa, win.to(DEV), extra, ext.to(DEV), sink.to(DEV), scale,
                        num_splits=num_splits, config=cfg, out=out)
    ref = R.sparse_decode_ref(qd.float(), swa, win.to(DEV), extra, ext.to(DEV), sink.to(DEV), scale)
    _check_attention(got, ref, qd, swa, win, extra, ext, sink, scale, live=slice(0, 2))
    assert (got.out[2] == 0).all() and torch.isposinf(got.lse[2]).all(), "request with no key"


def test_sparse_decode_window_only():
    g = _gen(50)
    b, h = 2, 16
    swa = _kv_pool(2, 128, g)
    win = torch.randint(0, 256, (b, 128), generator=g).to(DEV)
    q = (torch.randn(b, h, 512, generator=g)).to(DEV)
    if DEV == "cuda":
        q = q.bfloat16()
    sink = torch.randn(h, generator=g).to(DEV)
    got = sparse_decode(q, swa, win, None, None, sink, 0.05)
    ref = R.sparse_decode_ref(q.float(), swa, win, None, None, sink, 0.05)
    _check_attention(got, ref, q, swa, win, None, None, sink, 0.05)


def test_sparse_decode_small_batch_rule():
    """One request of 64 heads (Flash's) over 128 + 200 keys with no config given: the
    small-batch rule's launch (4 head blocks of 16, 32-key tiles, 11 splits, the merge) against
    the float64 reference; and the rule's boundaries."""
    from dsv4_backend.kernels.sparse_attention import SMALL_BATCH_CONFIG, decode_launch_rule
    assert decode_launch_rule(1, 128 + 200) == (SMALL_BATCH_CONFIG, 11)
    assert decode_launch_rule(4, 128) == (SMALL_BATCH_CONFIG, 4)
    assert decode_launch_rule(4, 128 + 512) == (SMALL_BATCH_CONFIG, 16)
    assert decode_launch_rule(5, 128) == (DecodeAttentionConfig(), None)
    assert decode_launch_rule(1, 128 + 8192) == (DecodeAttentionConfig(), None)
    g = _gen(51)
    h, k = 64, 200
    swa = _kv_pool(2, 128, g)
    extra = _kv_pool(4, 64, g)
    win = torch.randint(0, 256, (1, 128), generator=g)
    ext = torch.randint(0, 256, (1, k), generator=g)
    ext[0, 5::7] = -1
    q = torch.randn(1, h, 512, generator=g) * 3
    qd = q.to(DEV).to(torch.bfloat16 if DEV == "cuda" else torch.float32)
    sink = torch.randn(h, generator=g)
    got = sparse_decode(qd, swa, win.to(DEV), extra, ext.to(DEV), sink.to(DEV), 512 ** -0.5)
    ref = R.sparse_decode_ref(qd.float(), swa, win.to(DEV), extra, ext.to(DEV), sink.to(DEV), 512 ** -0.5)
    _check_attention(got, ref, qd, swa, win, extra, ext, sink, 512 ** -0.5)
