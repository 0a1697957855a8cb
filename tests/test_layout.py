"""FP8 row formats: exact bytes at documented offsets, bit-exact round trips, pool gather/scatter.

The references here are independent of memory.quant: e4m3 values come from decoding the 256 bit
patterns by the format's definition, scales from exact rational arithmetic, bf16 from rounding
the significand to 8 bits in float64.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memory.layout import (
    INDEXER_ROW_BYTES, KV_NOPE_BYTES, KV_ROPE_BYTES, KV_ROW_BYTES, KV_SCALE_BYTES,
    pack_indexer_page, pack_kv_page, read_indexer_rows, read_kv_rows, unpack_indexer_page,
    unpack_kv_page, write_indexer_rows, write_kv_rows,
)
from memory.quant import (
    indexer_dequantize, indexer_fake_quant, indexer_quantize, kv_dequantize, kv_fake_quant,
    kv_quantize, pow2_scale, to_e4m3_bits,
)

PART = KV_NOPE_BYTES + KV_ROPE_BYTES  # 576


# ---- independent references -------------------------------------------------------------------

def _e4m3_value(bits: int) -> float:
    sign = -1.0 if bits & 0x80 else 1.0
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


E4M3_ALL = np.array([_e4m3_value(b) for b in range(256)])  # value of every code
E4M3_POS = E4M3_ALL[:0x7F]  # codes 0x00..0x7E, increasing


def ref_e4m3_bits(y: np.ndarray) -> np.ndarray:
    """Round to nearest e4m3 (ties to even code), saturating at 448; uint8 codes."""
    a = np.minimum(np.abs(y), 448.0)
    lo = np.clip(np.searchsorted(E4M3_POS, a, side="right") - 1, 0, 0x7E)
    hi = np.minimum(lo + 1, 0x7E)
    d_lo, d_hi = a - E4M3_POS[lo], E4M3_POS[hi] - a
    code = np.where(d_hi < d_lo, hi, np.where(d_lo < d_hi, lo, np.where(lo % 2 == 0, lo, hi)))
    return (code | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8)


def ref_exponent(amax: float, floor: float) -> int:
    """Smallest k with 2**k >= max(amax, floor) / 448, in exact arithmetic."""
    r = Fraction(max(amax, floor)) / 448
    k = math.floor(math.log2(r)) - 2
    while Fraction(2) ** k < r:
        k += 1
    return k


def ref_bf16(x: np.ndarray) -> np.ndarray:
    m, e = np.frexp(x)
    return np.ldexp(np.round(m * 256.0), e - 8)  # np.round: half to even


def ref_bf16_bytes(x: np.ndarray) -> np.ndarray:
    bits = (ref_bf16(x).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return np.stack([bits & 0xFF, bits >> 8], axis=-1).astype(np.uint8).reshape(*x.shape[:-1], -1)


def _floor(dtype: torch.dtype) -> float:
    return float(torch.tensor(1e-4, dtype=dtype))


def ref_kv(rows: torch.Tensor):
    """-> (dequantised float64 [N, 512], part bytes [N, 576], scale-group bytes [N, 8])."""
    x = rows.double().numpy()
    n = x.shape[0]
    deq = np.empty((n, 512))
    parts, groups = np.empty((n, PART), np.uint8), np.zeros((n, 8), np.uint8)
    for i in range(n):
        for t in range(7):
            tile = x[i, 64 * t: 64 * (t + 1)]
            k = ref_exponent(float(np.abs(tile).max()), _floor(rows.dtype))
            y = (tile / 2.0 ** k).astype(np.float32).astype(np.float64)
            bits = ref_e4m3_bits(y)
            parts[i, 64 * t: 64 * (t + 1)] = bits
            deq[i, 64 * t: 64 * (t + 1)] = E4M3_ALL[bits] * 2.0 ** k
            groups[i, t] = k + 127
    deq[:, 448:] = ref_bf16(x[:, 448:])
    parts[:, 448:] = ref_bf16_bytes(x[:, 448:])
    return deq, parts, groups


def ref_indexer(rows: torch.Tensor):
    """-> (dequantised float64 [N, 128], value bytes [N, 128], fp32 scale bytes [N, 4])."""
    x = rows.double().numpy()
    deq, values, scales = np.empty_like(x), np.empty(x.shape, np.uint8), []
    for i in range(x.shape[0]):
        k = ref_exponent(float(np.abs(x[i]).max()), _floor(rows.dtype))
        values[i] = ref_e4m3_bits((x[i] / 2.0 ** k).astype(np.float32).astype(np.float64))
        deq[i] = E4M3_ALL[values[i]] * 2.0 ** k
        scales.append(np.array([2.0 ** k], np.dtype("<f4")).view(np.uint8))
    return deq, values, np.stack(scales)


def varied_rows(n: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows whose 64-dim tiles span tiny (below the 1e-4 floor), ordinary and huge
    magnitudes, with negative values and exact power-of-two maxima mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g, dtype=torch.float64)
    top = 30.0 if dtype == torch.float32 else 35.0
    mags = 10.0 ** (torch.rand(n, dim // 64, generator=g, dtype=torch.float64) * (top + 12) - 12)
    x = (x.view(n, -1, 64) * mags.unsqueeze(-1)).view(n, dim)
    x[0, :64] = 1e-9 * torch.randn(64, generator=g, dtype=torch.float64)  # floored tile
    x[1, 64:128] = -x[1, 64:128].abs()  # all-negative tile
    x[2, :64] *= 448.0 * 2.0 ** 5 / x[2, :64].abs().max()  # amax exactly 448 * 2^5
    return x.to(dtype)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    diff = actual.view(-1) != expected.view(-1)
    if diff.any():
        i = int(diff.nonzero()[0])
        pytest.fail(f"{int(diff.sum())} elements differ; first at flat {i}: "
                    f"{actual.view(-1)[i].item()!r} vs {expected.view(-1)[i].item()!r}")


# ---- e4m3 and scales --------------------------------------------------------------------------

def test_e4m3_known_bit_patterns():
    y = torch.tensor([1.0, -1.0, 2.0 ** -9, 3 * 2.0 ** -9, 2.0 ** -6, 448.0, 500.0, -1e6,
                      2.0 ** -10, 1.0625, 1.1875, 384.0])
    expected = [0x38, 0xB8, 0x01, 0x03, 0x08, 0x7E, 0x7E, 0xFE, 0x00, 0x38, 0x3A, 0x7C]
    assert to_e4m3_bits(y).tolist() == expected
    assert ref_e4m3_bits(y.double().numpy()).tolist() == expected


def test_e4m3_rounding_matches_definition():
    g = torch.Generator().manual_seed(1)
    mags = 10.0 ** torch.empty(4000).uniform_(-4, 2.8, generator=g)
    y = torch.cat([torch.randn(4000, generator=g) * mags,
                   torch.from_numpy(E4M3_POS).float(),
                   torch.from_numpy((E4M3_POS[:-1] + E4M3_POS[1:]) / 2).float()])  # exact ties
    assert to_e4m3_bits(y).tolist() == ref_e4m3_bits(y.double().numpy()).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pow2_scale_exact(dtype):
    g = torch.Generator().manual_seed(2)
    special = [0.0, 1e-6, 1e-4, 448.0, 447.99, 449.0, 1.0, 3.5]
    special += [448.0 * 2.0 ** k for k in range(-30, 40, 7)]
    amax = torch.cat([torch.tensor(special, dtype=torch.float64),
                      10.0 ** torch.empty(200, dtype=torch.float64).uniform_(-8, 30, generator=g)])
    amax = amax.to(dtype)
    amax = torch.cat([amax, torch.nextafter(amax, torch.full_like(amax, math.inf)),
                      torch.nextafter(amax, torch.zeros_like(amax))])
    scale, exponent = pow2_scale(amax)
    assert scale.dtype == dtype
    for a, s, e in zip(amax.tolist(), scale.tolist(), exponent.tolist()):
        k = ref_exponent(a, _floor(dtype))
        assert (e, s) == (k, 2.0 ** k), f"amax={a!r}: got 2^{e}, want 2^{k}"


# ---- attention page bytes ---------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [4, 64])
def test_kv_page_bytes_at_offsets(page_size):
    rows = varied_rows(page_size, 512, torch.float32, seed=page_size)
    j = page_size - 2
    row = torch.zeros(512)
    row[:8] = torch.tensor([1.0, -1.0, 2.0 ** -9, 448.0, -448.0, 3 * 2.0 ** -9, 2.0 ** -10, 0.5])
    row[8:64] = 0.25
    row[64:128] = torch.linspace(-1.0, 1.0, 64)
    row[64], row[65] = 3.0, -3.0  # amax 3 -> scale 2^-7
    # tile 2 (128:192) stays zero: amax floored at 1e-4 -> scale 2^-22
    row[192:256] = 1e30 * torch.linspace(-0.5, 1.0, 64)
    g = torch.Generator().manual_seed(9)
    row[256:448] = torch.randn(192, generator=g)
    row[448:452] = torch.tensor([1.0, -2.0, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -9])
    row[452:] = torch.randn(60, generator=g)
    rows[j] = row

    page = pack_kv_page(rows)
    assert page.dtype == torch.uint8 and page.shape == (page_size * KV_ROW_BYTES,)
    part = page[j * PART:(j + 1) * PART].tolist()
    group = page[page_size * PART + j * KV_SCALE_BYTES:][:KV_SCALE_BYTES].tolist()
    assert part[:8] == [0x38, 0xB8, 0x01, 0x7E, 0xFE, 0x03, 0x00, 0x30]  # tile scale 2^0
    assert part[64:66] == [0x7C, 0xFC]  # +-3 / 2^-7 = +-384
    assert part[128:192] == [0] * 64
    assert part[448:456] == [0x80, 0x3F, 0x00, 0xC0, 0x80, 0x3F, 0x81, 0x3F]  # bf16 LE
    k3 = ref_exponent(float(row[192:256].abs().max()), _floor(torch.float32))
    assert group[:4] == [127, 127 - 7, 127 - 22, 127 + k3] and group[7] == 0

    # Every row: its 576-byte part at r*576 and its scale group at P*576 + r*8.
    _, parts, groups = ref_kv(rows)
    expected = np.concatenate([parts.reshape(-1), groups.reshape(-1)])
    assert page.tolist() == expected.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kv_round_trip_bit_exact(dtype):
    rows = varied_rows(40, 512, dtype, seed=3)
    for p in (4, 8):  # ten and five pages
        pages = rows.view(-1, p, 512)
        got = torch.cat([unpack_kv_page(pack_kv_page(pg), p) for pg in pages])
        assert got.dtype == torch.float32
        assert_bits_equal(got.to(dtype), kv_fake_quant(rows))
    assert_bits_equal(kv_dequantize(kv_quantize(rows), dtype), kv_fake_quant(rows))
    deq, _, _ = ref_kv(rows)
    assert_bits_equal(kv_fake_quant(rows).double(), torch.from_numpy(deq))


def test_kv_fake_quant_bf16_input():
    rows = varied_rows(6, 512, torch.float32, seed=4).to(torch.bfloat16)
    out = kv_fake_quant(rows)
    assert out.dtype == torch.bfloat16
    assert_bits_equal(out.float(), kv_fake_quant(rows.float()))  # the cast back is exact


# ---- indexer page bytes -----------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [4, 64])
def test_indexer_page_bytes_at_offsets(page_size):
    rows = varied_rows(page_size, 128, torch.float32, seed=10 + page_size)
    j = page_size - 3
    rows[j] = torch.linspace(-3.0, 3.0, 128)
    rows[j, :2] = torch.tensor([3.5, 1.0])  # amax/448 = 2^-7 exactly -> scale 2^-7
    page = pack_indexer_page(rows)
    assert page.shape == (page_size * INDEXER_ROW_BYTES,)
    assert page[j * 128:j * 128 + 2].tolist() == [0x7E, 0x70]  # 448, 128
    off = page_size * 128 + j * 4
    assert page[off:off + 4].tolist() == [0x00, 0x00, 0x00, 0x3C]  # fp32 2^-7, little-endian
    _, values, scales = ref_indexer(rows)
    expected = np.concatenate([values.reshape(-1), scales.reshape(-1)])
    assert page.tolist() == expected.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_indexer_round_trip_bit_exact(dtype):
    rows = varied_rows(32, 128, dtype, seed=5)
    got = torch.cat([unpack_indexer_page(pack_indexer_page(pg), 8) for pg in rows.view(4, 8, 128)])
    assert got.dtype == torch.float32
    assert_bits_equal(got.to(dtype), indexer_fake_quant(rows))
    assert_bits_equal(indexer_dequantize(indexer_quantize(rows), dtype), indexer_fake_quant(rows))
    deq, _, _ = ref_indexer(rows)
    assert_bits_equal(indexer_fake_quant(rows).double(), torch.from_numpy(deq))


# ---- pools ------------------------------------------------------------------------------------

def _place(expected: torch.Tensor, slot: int, page_size: int, head: torch.Tensor,
           tail: torch.Tensor) -> None:
    page, r = divmod(slot, page_size)
    h, t = head.numel(), tail.numel()
    expected[page, r * h:(r + 1) * h] = head
    expected[page, page_size * h + r * t:page_size * h + (r + 1) * t] = tail


@pytest.mark.parametrize("page_size,pad", [(4, 0), (64, 0), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kv_pool_write_read(page_size, pad, dtype):
    g = torch.Generator().manual_seed(page_size + pad)
    num_pages = 5
    pool = torch.randint(0, 256, (num_pages, page_size * KV_ROW_BYTES + pad), generator=g,
                         dtype=torch.uint8)
    before = pool.clone()
    slots = torch.randperm(num_pages * page_size, generator=g)[:9]
    rows = varied_rows(9, 512, dtype, seed=6)
    write_kv_rows(pool, slots, rows)

    expected = before.clone()
    for i, s in enumerate(slots.tolist()):
        one = pack_kv_page(rows[i:i + 1])  # a page of one row: [part | group]
        _place(expected, s, page_size, one[:PART], one[PART:])
    assert_bits_equal(pool, expected)  # written bytes in place, every other byte untouched

    fq = kv_fake_quant(rows)
    query = torch.stack([slots[:6], torch.tensor([-1, slots[6], -1, slots[7], slots[8], -1])])
    got = read_kv_rows(pool, query.view(2, 3, 2))
    assert got.shape == (2, 3, 2, 512) and got.dtype == torch.float32
    want = torch.zeros(2, 6, 512, dtype=dtype)
    want[0] = fq[:6]
    want[1, [1, 3, 4]] = fq[6:]
    assert_bits_equal(got.to(dtype), want.view(2, 3, 2, 512))
    for i, s in enumerate(slots.tolist()):  # agrees with the page function
        page, r = divmod(s, page_size)
        assert_bits_equal(unpack_kv_page(pool[page, :page_size * KV_ROW_BYTES], page_size)[r],
                          read_kv_rows(pool, slots[i:i + 1])[0])


@pytest.mark.parametrize("page_size,pad", [(4, 0), (64, 0), (64, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_indexer_pool_write_read(page_size, pad, dtype):
    g = torch.Generator().manual_seed(7 + page_size + pad)
    num_pages = 4
    pool = torch.randint(0, 256, (num_pages, page_size * INDEXER_ROW_BYTES + pad), generator=g,
                         dtype=torch.uint8)
    before = pool.clone()
    slots = torch.randperm(num_pages * page_size, generator=g)[:7]
    rows = varied_rows(7, 128, dtype, seed=8)
    write_indexer_rows(pool, slots, rows)

    expected = before.clone()
    for i, s in enumerate(slots.tolist()):
        one = pack_indexer_page(rows[i:i + 1])
        _place(expected, s, page_size, one[:128], one[128:])
    assert_bits_equal(pool, expected)

    query = torch.cat([slots, torch.tensor([-1])]).view(2, 4)
    got = read_indexer_rows(pool, query)
    assert got.shape == (2, 4, 128) and got.dtype == torch.float32
    want = torch.cat([indexer_fake_quant(rows), torch.zeros(1, 128, dtype=dtype)]).view(2, 4, 128)
    assert_bits_equal(got.to(dtype), want)
    for i, s in enumerate(slots.tolist()):
        page, r = divmod(s, page_size)
        page_bytes = pool[page, :page_size * INDEXER_ROW_BYTES]
        assert_bits_equal(unpack_indexer_page(page_bytes, page_size)[r],
                          got.view(-1, 128)[i])


def test_pool_rejects_bad_slots_and_shapes():
    pool = torch.zeros(2, 4 * KV_ROW_BYTES, dtype=torch.uint8)
    rows = torch.randn(2, 512)
    with pytest.raises(ValueError, match="slots"):
        write_kv_rows(pool, torch.tensor([0, 8]), rows)  # 8 rows fit: 0..7
    with pytest.raises(ValueError, match="slots"):
        write_kv_rows(pool, torch.tensor([-1, 3]), rows)
    with pytest.raises(ValueError, match="slots"):
        read_kv_rows(pool, torch.tensor([[0, 9]]))
    with pytest.raises(ValueError, match="one slot per row"):
        write_kv_rows(pool, torch.tensor([1, 2, 3]), rows)
    with pytest.raises(ValueError, match=r"\[N, 512\]"):
        write_kv_rows(pool, torch.tensor([1, 2]), torch.randn(2, 576))
    with pytest.raises(ValueError, match="bytes"):
        unpack_kv_page(torch.zeros(4 * KV_ROW_BYTES - 1, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="float32 max"):
        kv_fake_quant(torch.full((1, 512), 1e300, dtype=torch.float64))


# ---- error bound (property) -------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-12.0, 30.0), min_size=8, max_size=8), st.integers(0, 2 ** 31 - 1))
def test_kv_error_within_half_ulp(log10_mags, seed):
    g = torch.Generator().manual_seed(seed)
    mags = 10.0 ** torch.tensor(log10_mags, dtype=torch.float64)
    x = (torch.randn(3, 8, 64, generator=g, dtype=torch.float64) * mags.view(1, 8, 1)).view(3, 512)
    x = x.float()
    q = kv_quantize(x)
    x64 = x.double()
    deq = kv_dequantize(q, torch.float64)
    scale = 2.0 ** (q.scale_exp.double() - 127)  # [3, 7]
    for i in range(3):
        for t in range(7):
            amax = max(float(x[i, 64 * t:64 * (t + 1)].abs().max()), _floor(torch.float32))
            amax = Fraction(amax)
            s = Fraction(float(scale[i, t]))
            assert s / 2 < amax / 448 <= s, "scale is not the smallest power of two"
    xt = x64[:, :448].view(3, 7, 64)
    y = (xt / scale.unsqueeze(-1)).abs()
    binade = torch.floor(torch.log2(y.clamp_min(2.0 ** -6))).clamp_min(-6)
    bound = 2.0 ** (binade - 3) / 2 * scale.unsqueeze(-1)  # half an e4m3 ulp, in x units
    err = (deq[:, :448].view(3, 7, 64) - xt).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), f"nope error {err.view(-1)[worst]} > {bound.view(-1)[worst]}"
    rope = x64[:, 448:]
    rbound = 2.0 ** (torch.floor(torch.log2(rope.abs())) - 8)  # half a bf16 ulp
    rerr = (deq[:, 448:] - rope).abs()
    assert bool((rerr <= rbound).all()), f"rope error {rerr.max()} over half a bf16 ulp"
