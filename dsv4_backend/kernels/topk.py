"""Exact per-row top-k positions of an fp32 score matrix, graph-capturable.

``topk_positions(scores [b, L] fp32, k)`` returns int64 ``[b, min(k, L)]`` positions, best first,
identical to ``torch.topk`` on the packed int64 key that ``indexer.topk_rows`` has always used::

    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)        # int32, same order as the floats
    key     = (ordered << 32) | (0xFFFFFFFF - position)  # int64, unique within a row

Keys are unique, so "the k largest keys, descending" is one well-defined list: larger score
first, equal scores (equal bit patterns; -0.0 < +0.0, -inf is a value like any other) toward the
lower position. Nothing here synchronises with the host and every shape depends only on
(b, L, k), so it runs inside a captured CUDA graph.

Radix select (``method="radix"``, the default), all kernels over (row, segment) programs:

1. Floor. Group g of a row holds the positions j = g (mod G), G = next_pow2(k) <= L; each
   program takes its tiles' group maxima and ``atomic_max``es them into ``gmax[row, G]``. With
   v = min_g gmax[row, g], at least G >= k elements are >= v, so the k-th largest score T >= v
   and every element below v can be ignored from here on. On random scores v keeps a few k.
   Only in launches of more than 2^21 scores (``TopKConfig.floor_min_elements``): below that
   the passes over every element cost less than this extra read (measured, see the config).
2. Passes p = 0..ceil(32/BITS)-1 histogram digit p of u = ordered ^ 0x80000000 (an unsigned
   order) over the kept elements whose higher digits equal the prefix found so far. Each
   program re-derives that prefix from the finished histograms of the earlier passes (the bin
   where the count of larger elements reaches k). A tile with many such elements adds them with
   ``tl.histogram`` (cost grows with the bin count, so BITS = 8), a tile with few with one
   atomic add each. After the last pass the prefix is T itself and ``need`` (>= 1) says how many
   elements equal to T belong to the top k. Exact: the counts above any bin >= v are the full
   row's counts, because only elements < v <= T were dropped.
3. Compaction writes the packed keys of every element > T (exactly k - need of them; slots from
   a per-row atomic counter, order irrelevant) and of the first ``need`` elements equal to T in
   position order: a segment learns how many T's precede it from the last pass's per-segment
   histograms.
4. Ranking: the k survivors are exactly the k largest keys; each one's rank is the number of
   survivors with a larger key, an all-pairs count split over (row, block of 64 survivors)
   programs, and it is stored at out[row, rank].

Cost: 1 + ceil(32/BITS) + 1 reads of the scores (4 B per element), histogram work only where
elements survive the floor, k^2 key compares per row, 9 launches at BITS=8 (2 fills, the floor,
4 passes, compaction, ranking), 7 without the floor.
Why steps 1, 2's atomics and 4 exist (H200, an earlier version without them, which did pass
the same exactness checks): ``tl.histogram`` builds each bin from one warp ballot per digit bit,
so every element costs about BITS * 2^BITS / 32 instructions; with it on every tile the passes
were compute-bound (b=128, L=262144: 0.9 ms, 0.7 TB/s; 11-bit digits 5x slower), and
``tl.sort`` of the 1024 survivors in one program took ~25 us of a 41 us call at b=1.
Short rows (``TopKConfig.rank_all_max``, 2,048, in launches of at most ``rank_all_compares``
key compares) skip steps 1-4: every element's rank is counted against the whole row (L^2
compares, one launch) and the k best stored at their ranks.
``method="torch"`` (one ``torch.topk`` on the packed key, the reference) and ``"torch2"``
(top-k per segment of S positions, then top-k of those; exact since each of the k largest keys
is in its segment's top k) are kept for comparison; ``bench/bench_topk.py`` measures all three.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import interpreting
from dsv4_backend.kernels import pdl
from dsv4_backend.kernels.pdl import wait as pdl_wait

# topk_rows uses the kernels on CUDA tensors; under TRITON_INTERPRET=1 only when a test sets this.
INTERPRET_KERNELS = False

INT32_MIN = -(1 << 31)
INT64_MIN = -(1 << 63)
_I32_MIN = tl.constexpr(INT32_MIN)
_KEY_MIN = tl.constexpr(INT64_MIN)  # below every packed key: their low half 0xFFFFFFFF - pos is > 0
MAX_KERNEL_K = 4096  # larger k goes to torch.topk


class TopKConfig(NamedTuple):
    method: str = "radix"  # "radix" | "torch2" | "torch"
    bits: int = 8  # radix digit width: 4 passes of 256 bins
    block: int = 1024  # elements per tile
    num_warps: int = 4
    programs: int | None = None  # programs to aim for per launch; None: 4 per SM
    sparse: int = 128  # a tile with at most this many live elements uses atomics, not tl.histogram
    # step 1, where a launch has more than floor_min_elements scores (b * L) and next_pow2(k) <= L:
    # below that it costs more than it saves (H200, k = 512: without it 20.0 against 23.6 us at
    # b = 1, L = 1024, 26.4 against 30.2 at b = 1, L = 262144, 52.6 against 54.7 at b = 64,
    # L = 32768; with it 68.4 against 75.6 at b = 16, L = 262144; bench_topk.py --floor-sweep)
    floor: bool = True
    floor_min_elements: int = 1 << 21
    # step 1's own launch: elements per tile, and at most this many programs per row, each of
    # which atomic_maxes all G group maxima of its row (on the H200 256 programs a row at
    # b = 1, L = 262144 serialised on those G addresses: 15 us for a 1 MB read)
    floor_tile: int = 4096
    floor_segments: int = 32
    segment: int = 8192  # "torch2" segment length
    # rows of at most rank_all_max scores, in launches of at most rank_all_compares key compares
    # (b * L^2): every element ranked against the whole row in one launch (_rank_all_kernel)
    # instead of the 7-9 launches of steps 1-4; rank_all_max = 0: never. H100, k = 512, graph
    # replay (docs/PERF.md session 20): b = 1, L = 1,024 6.3 against 17.8 us; b = 1, L = 2,048
    # 11.0 against 19.1; b = 32, L = 1,024 (2^25 compares) 17.3 against 20.1; b = 32, L = 2,048
    # (2^27) 54.6 against 21.1. The budget, 2^24, keeps the launches that won by 2x or more.
    rank_all_max: int = 2048
    rank_all_compares: int = 1 << 24


def kernels_wanted(scores: torch.Tensor) -> bool:
    """Whether ``topk_rows`` should call :func:`topk_positions` for these scores."""
    return scores.is_cuda or (INTERPRET_KERNELS and interpreting())


def packed_keys(scores: torch.Tensor) -> torch.Tensor:
    """The reference key, int64 [b, L]: ordered score bits, then the complemented position."""
    bits = scores.contiguous().view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 order == float order
    pos = torch.arange(scores.shape[1], device=scores.device, dtype=torch.int64)
    return (ordered.to(torch.int64) << 32) | (0xFFFFFFFF - pos)[None, :]


def topk_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """One ``torch.topk`` on the packed key: int64 [b, min(k, L)] positions, best first."""
    return torch.topk(packed_keys(scores), min(k, scores.shape[1]), dim=1).indices


def _topk_two_stage(scores: torch.Tensor, kk: int, segment: int) -> torch.Tensor:
    b, L = scores.shape
    keys = packed_keys(scores)
    if L <= segment or segment < kk:
        top = torch.topk(keys, kk, dim=1).values
    else:
        nseg = triton.cdiv(L, segment)
        keys = torch.nn.functional.pad(keys, (0, nseg * segment - L), value=INT64_MIN)
        part = torch.topk(keys.view(b * nseg, segment), kk, dim=1).values  # [b * nseg, kk]
        top = torch.topk(part.view(b, nseg * kk), kk, dim=1).values
    return 0xFFFFFFFF - (top & 0xFFFFFFFF)


@triton.jit
def _ordered(bits):
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _pack_key(ordered, offs):
    """The packed int64 key of ordered score bits at positions offs (``packed_keys``)."""
    return (ordered.to(tl.int64) << 32) | (4294967295 - offs.to(tl.int64))


@triton.jit
def _floor(gmax_ptr, row, G: tl.constexpr, FLOOR: tl.constexpr):
    """v: at least G >= k elements of the row are >= v (ordered int32)."""
    if FLOOR:
        v = tl.min(tl.load(gmax_ptr + row * G + tl.arange(0, G)), axis=0)
    else:
        v = row * 0 + _I32_MIN
    return v


@triton.jit
def _threshold(hist_ptr, row, b, k, NPASS: tl.constexpr, BITS: tl.constexpr, NBINS: tl.constexpr):
    """(prefix of the k-th largest u over the first NPASS digits, how many elements with that
    prefix belong to the top k), from the finished histograms of passes 0..NPASS-1."""
    idx = tl.arange(0, NBINS)
    prefix = row * 0
    need = row * 0 + k
    for q in tl.static_range(NPASS):
        shift = tl.maximum(32 - (q + 1) * BITS, 0)
        h = tl.load(hist_ptr + (q * b + row) * NBINS + idx)
        above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0)  # elements in higher bins
        sel = (above < need) & (above + h >= need)
        d = tl.sum(tl.where(sel, idx, 0), axis=0)
        need -= tl.sum(tl.where(sel, above, 0), axis=0)
        prefix = prefix | (d << shift)
    return prefix, need


# Shapes and shifts vary per call; specialising on them would recompile for every batch size.
_DYNAMIC = ["sb", "L", "seg_len", "b", "k", "nseg", "shift", "pmask", "last_shift"]


@triton.jit(do_not_specialize=_DYNAMIC)
def _floor_kernel(bits_ptr, sb, L, seg_len, gmax_ptr, G: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1) * seg_len  # a multiple of TILE (itself of G), so tile column c is group c
    end = tl.minimum(start + seg_len, L)
    base = bits_ptr + row.to(tl.int64) * sb
    acc = tl.full((G,), _I32_MIN, tl.int32)
    for j0 in range(start, end, TILE):
        offs = j0 + tl.arange(0, TILE)
        x = tl.where(offs < end, _ordered(tl.load(base + offs, mask=offs < end, other=0)), _I32_MIN)
        acc = tl.maximum(acc, tl.max(tl.reshape(x, (TILE // G, G)), axis=0))
    g = tl.arange(0, G)
    tl.atomic_max(gmax_ptr + row * G + g, acc, mask=acc > _I32_MIN, sem="relaxed")


@triton.jit(do_not_specialize=_DYNAMIC)
def _radix_pass_kernel(bits_ptr, sb, L, seg_len, b, k, gmax_ptr, hist_ptr, seg_hist_ptr, nseg,
                       shift, pmask, PASS: tl.constexpr, LAST: tl.constexpr, G: tl.constexpr,
                       FLOOR: tl.constexpr, BITS: tl.constexpr, NBINS: tl.constexpr,
                       BLOCK: tl.constexpr, SPARSE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    row = tl.program_id(0)
    seg = tl.program_id(1)
    v = _floor(gmax_ptr, row, G, FLOOR)
    prefix, need = _threshold(hist_ptr, row, b, k, PASS, BITS, NBINS)
    hist_row = hist_ptr + (PASS * b + row) * NBINS
    seg_row = seg_hist_ptr + (row * nseg + seg) * NBINS  # last pass: this segment's counts
    base = bits_ptr + row.to(tl.int64) * sb
    start = seg * seg_len
    end = tl.minimum(start + seg_len, L)
    acc = tl.zeros((NBINS,), tl.int32)
    for j0 in range(start, end, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        ordered = _ordered(tl.load(base + offs, mask=offs < end, other=0))
        u = ordered ^ _I32_MIN  # unsigned order; masking after the arithmetic shift is exact
        live = (offs < end) & (ordered >= v) & ((u & pmask) == prefix)
        digit = (u >> shift) & (NBINS - 1)
        n = tl.sum(live.to(tl.int32), axis=0)
        if n > SPARSE:
            acc += tl.histogram(digit, NBINS, mask=live)
        elif n > 0:
            tl.atomic_add(hist_row + digit, live.to(tl.int32), mask=live, sem="relaxed")
            if LAST:
                tl.atomic_add(seg_row + digit, live.to(tl.int32), mask=live, sem="relaxed")
    idx = tl.arange(0, NBINS)
    tl.atomic_add(hist_row + idx, acc, mask=acc > 0, sem="relaxed")
    if LAST:
        tl.atomic_add(seg_row + idx, acc, mask=acc > 0, sem="relaxed")


@triton.jit(do_not_specialize=_DYNAMIC)
def _compact_kernel(bits_ptr, sb, L, seg_len, b, k, hist_ptr, seg_hist_ptr, nseg, count_ptr,
                    cand_ptr, last_shift, NPASS: tl.constexpr, BITS: tl.constexpr,
                    NBINS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    row = tl.program_id(0)
    seg = tl.program_id(1)
    t_u, need = _threshold(hist_ptr, row, b, k, NPASS, BITS, NBINS)
    t = t_u ^ _I32_MIN  # back to the signed order of `ordered`
    d_t = (t_u >> last_shift) & (NBINS - 1)
    ties = seg * 0  # elements == T in the segments before this one
    for s0 in range(0, seg, 128):
        s = s0 + tl.arange(0, 128)
        ties += tl.sum(tl.load(seg_hist_ptr + (row * nseg + s) * NBINS + d_t, mask=s < seg,
                               other=0), axis=0)
    n_gt = k - need
    base = bits_ptr + row.to(tl.int64) * sb
    out = cand_ptr + row.to(tl.int64) * k
    start = seg * seg_len
    end = tl.minimum(start + seg_len, L)
    for j0 in range(start, end, BLOCK):
        offs = j0 + tl.arange(0, BLOCK)
        ordered = _ordered(tl.load(base + offs, mask=offs < end, other=0))
        gt = (offs < end) & (ordered > t)
        eq = (offs < end) & (ordered == t)
        key = _pack_key(ordered, offs)
        n = tl.sum(gt.to(tl.int32), axis=0)
        if n > 0:
            slot = tl.atomic_add(count_ptr + row, n, sem="relaxed")
            tl.store(out + slot + tl.cumsum(gt.to(tl.int32), axis=0) - 1, key, mask=gt)
        n_eq = tl.sum(eq.to(tl.int32), axis=0)
        if (n_eq > 0) & (ties < need):
            tie_rank = ties + tl.cumsum(eq.to(tl.int32), axis=0) - 1
            tl.store(out + n_gt + tie_rank, key, mask=eq & (tie_rank < need))
        ties += n_eq


@triton.jit(do_not_specialize=["k", "ob"])
def _rank_kernel(cand_ptr, k, out_ptr, ob, BI: tl.constexpr, BJ: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BI + tl.arange(0, BI)
    keys = cand_ptr + row * k
    ki = tl.load(keys + i, mask=i < k, other=_KEY_MIN)
    rank = tl.zeros((BI,), tl.int32)
    for j0 in range(0, k, BJ):
        j = j0 + tl.arange(0, BJ)
        kj = tl.load(keys + j, mask=j < k, other=_KEY_MIN)
        rank += tl.sum((kj[None, :] > ki[:, None]).to(tl.int32), axis=1)
    tl.store(out_ptr + row * ob + rank, 4294967295 - (ki & 4294967295), mask=i < k)


@triton.jit
def _row_keys(base, offs, L):
    """The packed keys of a row's positions offs (int64; _KEY_MIN past L)."""
    ok = offs < L
    return tl.where(ok, _pack_key(_ordered(tl.load(base + offs, mask=ok, other=0)), offs), _KEY_MIN)


@triton.jit(do_not_specialize=["sb", "L", "kk", "ob"])
def _rank_all_kernel(bits_ptr, sb, L, kk, out_ptr, ob, BI: tl.constexpr, BJ: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    # program (row, i-block): each of BI positions' rank = how many keys of the row are larger
    # (keys are unique, so ranks are 0 .. L-1 once each); the kk best are stored at out[row, rank]
    row = tl.program_id(0).to(tl.int64)
    base = bits_ptr + row * sb
    i = tl.program_id(1) * BI + tl.arange(0, BI)
    ki = _row_keys(base, i, L)
    rank = tl.zeros((BI,), tl.int32)
    for j0 in range(0, L, BJ):
        kj = _row_keys(base, j0 + tl.arange(0, BJ), L)
        rank += tl.sum((kj[None, :] > ki[:, None]).to(tl.int32), axis=1)
    tl.store(out_ptr + row * ob + rank, i.to(tl.int64), mask=(i < L) & (rank < kk))


def _rank_all(bits: torch.Tensor, kk: int) -> torch.Tensor:
    b, L = bits.shape
    out = torch.empty(b, kk, dtype=torch.int64, device=bits.device)
    bi = 64
    _rank_all_kernel[(b, triton.cdiv(L, bi))](bits, bits.stride(0), L, kk, out, out.stride(0), BI=bi, BJ=256,
                                               num_warps=4, **pdl.args(bits.device))
    return out


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _radix(bits: torch.Tensor, kk: int, config: TopKConfig) -> torch.Tensor:
    b, L = bits.shape
    dev = bits.device
    nbits, block = config.bits, config.block
    nbins = 1 << nbits
    npass = triton.cdiv(32, nbits)
    G = triton.next_power_of_2(kk)
    use_floor = config.floor and G <= L and b * L > config.floor_min_elements
    tile = max(block, G)
    target = config.programs or 4 * _num_sms(dev)
    nseg = max(1, min(triton.cdiv(L, tile), triton.cdiv(target, b)))
    seg_len = triton.cdiv(triton.cdiv(L, nseg), tile) * tile
    nseg = triton.cdiv(L, seg_len)
    grid = (b, nseg)

    n_hist, n_seg = npass * b * nbins, b * nseg * nbins
    work = torch.zeros(n_hist + n_seg + b, dtype=torch.int32, device=dev)
    hist, seg_hist, count = work[:n_hist], work[n_hist:n_hist + n_seg], work[n_hist + n_seg:]
    if use_floor:
        gmax = torch.full((b, G), INT32_MIN, dtype=torch.int32, device=dev)
        ftile = max(config.floor_tile, G)      # a multiple of G: tile column c is group c
        fseg = triton.cdiv(triton.cdiv(L, min(triton.cdiv(L, ftile), config.floor_segments)), ftile) * ftile
        _floor_kernel[(b, triton.cdiv(L, fseg))](bits, bits.stride(0), L, fseg, gmax, G=G, TILE=ftile,
                                                 num_warps=config.num_warps)
    else:
        gmax = work  # unused
    shifts = [max(32 - (p + 1) * nbits, 0) for p in range(npass)]
    for p in range(npass):
        pmask = 0 if p == 0 else -(1 << shifts[p - 1])  # the digits already fixed, as int32
        _radix_pass_kernel[grid](
            bits, bits.stride(0), L, seg_len, b, kk, gmax, hist, seg_hist, nseg, shifts[p], pmask,
            PASS=p, LAST=p == npass - 1, G=G, FLOOR=use_floor, BITS=nbits, NBINS=nbins,
            BLOCK=block, SPARSE=config.sparse, num_warps=config.num_warps, **pdl.args(bits.device))
    cand = torch.empty(b, kk, dtype=torch.int64, device=dev)
    _compact_kernel[grid](bits, bits.stride(0), L, seg_len, b, kk, hist, seg_hist, nseg, count,
                          cand, shifts[-1], NPASS=npass, BITS=nbits, NBINS=nbins, BLOCK=block,
                          num_warps=config.num_warps, **pdl.args(bits.device))
    out = torch.empty(b, kk, dtype=torch.int64, device=dev)
    bi = 64
    _rank_kernel[(b, triton.cdiv(kk, bi))](cand, kk, out, out.stride(0), BI=bi, BJ=256, num_warps=4, **pdl.args(cand.device))
    return out


def topk_positions(scores: torch.Tensor, k: int, *,
                   config: TopKConfig = TopKConfig()) -> torch.Tensor:
    """int64 [b, min(k, L)]: each row's best positions of ``scores`` fp32 [b, L], best first,
    equal scores toward the lower position (exactly :func:`topk_reference`)."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be fp32 [b, L], got {scores.dtype} {tuple(scores.shape)}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    b, L = scores.shape
    kk = min(k, L)
    if b == 0 or kk == 0:
        return torch.empty(b, kk, dtype=torch.int64, device=scores.device)
    if config.method == "torch" or (config.method == "radix" and kk > MAX_KERNEL_K):
        return topk_reference(scores, kk)
    if config.method == "torch2":
        return _topk_two_stage(scores, kk, config.segment)
    if config.method != "radix":
        raise ValueError(f"unknown top-k method {config.method!r}")
    if scores.device.type != "cuda" and not interpreting():
        raise RuntimeError("the top-k kernels need a CUDA tensor, or TRITON_INTERPRET=1 on the CPU")
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    if L <= config.rank_all_max and b * L * L <= config.rank_all_compares:
        return _rank_all(scores.view(torch.int32), kk)
    return _radix(scores.view(torch.int32), kk, config)
