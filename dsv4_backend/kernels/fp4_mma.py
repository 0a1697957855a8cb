"""FP4 experts at decode sizes on the tensor cores: weights stored in MMA fragment order.

Why: the Triton decode GEMVs and grouped kernels of ``fp4_moe`` / ``fp4_moe_decode`` read FP4
weights at 10-24% of copy bandwidth on the H200, while the same tiles, only loaded, stream at
55-75% (docs/PERF.md, "FP4 experts on the tensor cores"). The gap is the conversion: each e2m1
nibble is decoded with several instructions and then moved, through shared memory, into the
layout the MMA wants. Here the weights are reordered once, at load, so that each lane's loaded
32-bit word already is its ``mma.m16n8k16`` A fragment: eight nibbles that become four fp16x2
registers with two bit operations each, no shared memory and no shuffle (the idea of Marlin-style
kernels; the code and the order are this project's).

The packed order (``pack_fp4_mma``). A weight matrix ``[N, K]`` is cut into 16-row tiles and
128-deep chunks; a (tile, chunk) is 1 KiB, 32 lanes x 8 words. Lane ``4 g + t`` (g = 0..7,
t = 0..3) word ``2 G + h`` (scale group G = 0..3 of the chunk, half h) holds the weights of rows
``g`` and ``g + 8`` at the chunk's columns ``32 G + 8 t + 4 h + {0, 1, 2, 3}``: this permutes K
inside each 32-deep scale group so that the lane's eight activation bytes of a group are
contiguous and every MMA stays inside one scale group. Within the word, MMA register p = 0..3
(rows g, g+8, g, g+8; columns +0/1, +0/1, +2/3, +2/3) takes its low half from bits 12-15 of
``word << 4p`` and its high half from bits 28-31. Each nibble keeps its e2m1 code
``s e1 e0 m``; moving ``e1 e0 m`` down three bits gives the fp16 of value x 2^-14 (the e2m1
subnormal 0.5 becomes the fp16 subnormal 2^-15). The 1x32 e8m0 scales of a (tile, chunk) are
``[16 rows, 4 groups]`` bytes, read as one 32-bit word per row.

The kernel (``fp4_mma.cu``, compiled at first use by NVRTC through torch) has the contract of
``fp4_moe_decode.fp4_gemv`` (fp32 partials ``[splits, P, N]`` at each pair's row), so the rest of
the decode MoE (SwiGLU + act-quant, combine) is unchanged. Numerics are the same W4A8 products:
every product of an e2m1 weight and an e4m3 activation is exact in fp32; the MMA sums each
32-deep group in fp32, the group sum is scaled by the weight's power of two and each 128-deep
chunk by the activation's; only the fp32 sums round (bound: ``tests/bounds.py``). The e8m0 scale
must be at most 240 (2^113): checked at packing, as the Triton kernels assume the same range.

``emulate_fp4_mma`` recomputes the kernel in float64 from the packed words and the activation
bytes, following the PTX fragment rules for A, B and C register by register: on the CPU it
checks the order, the bit moves and the kernel's addressing without a GPU.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from dsv4_backend import side_stream
from dsv4_backend.kernels import fp4_moe_prefill, pdl
from dsv4_backend.kernels.fp4_moe import route_pairs
from dsv4_backend.kernels.fp4_moe_decode import combine_splits, swiglu_quant
from dsv4_backend.kernels.fp8_gemm import act_quant_fp8, fp8_block_gemm_partials
from dsv4_backend.side_stream import SideBranch

SOURCE = Path(__file__).with_name("fp4_mma.cu")
MAX_SCALE_BYTE = 240  # the packed byte s + 14 must stay below 255 (an fp32 exponent field)
SCALE_BIAS = 14  # packed scale byte = e8m0 byte + 14: the fp16 weights are the values x 2^-14
# Bit of each A register's low half holding the code's e1 e0 m (three bits up) and its sign, in a
# packed word (fp4_mma.cu, dequant_word: register 0 in place, 1 three bits down, 2 and 3 apart).
MAG_BIT = (9, 6, 3, 0)
SIGN_BIT = (15, 12, 14, 13)
ROWS_PER_CTA = 64  # four warps of one 16-row tile each


class Fp4MmaPack(NamedTuple):
    words: torch.Tensor  # int32 [E, N/16, K/128, 32, 8]: the weights in fragment order
    scales: torch.Tensor  # int32 [E, N/16, K/128, 16]: per row, the chunk's four e8m0 bytes
    n: int
    k: int


def _nibble_bits(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [8] each: where nibble q = 4 bb + 2 rh + a of a packed word keeps its e1 e0 m bits and
    its sign (register p = rh + 2 bb, half a; MAG_BIT / SIGN_BIT)."""
    q = torch.arange(8, device=device)
    p = (q // 2) % 2 + 2 * (q // 4)
    half = 16 * (q % 2)
    return ((torch.tensor(MAG_BIT, device=device)[p] + half).to(torch.int64),
            (torch.tensor(SIGN_BIT, device=device)[p] + half).to(torch.int64))


def pack_fp4_mma(w: torch.Tensor, w_scale: torch.Tensor, experts_per_step: int = 16) -> Fp4MmaPack:
    """Release-format FP4 experts (``w`` uint8 ``[E, N, K/2]``, low nibble = even K; ``w_scale``
    uint8 e8m0 ``[E, N, K/32]``) -> the fragment order above, on w's device, a few experts at a
    time (the unpacked codes of one step are ``experts_per_step x N x K`` bytes)."""
    if w.dtype != torch.uint8 or w_scale.dtype != torch.uint8 or w.dim() != 3:
        raise ValueError(f"pack_fp4_mma: want uint8 [E, N, K/2] and [E, N, K/32], got {w.dtype} "
                         f"{tuple(w.shape)} and {w_scale.dtype} {tuple(w_scale.shape)}")
    E, N, half = w.shape
    K = 2 * half
    if N % 16 or K % 128 or tuple(w_scale.shape) != (E, N, K // 32):
        raise ValueError(f"pack_fp4_mma: N={N} must be a multiple of 16, K={K} of 128, scales "
                         f"[E, N, K/32]; got scales {tuple(w_scale.shape)}")
    top = int(w_scale.max()) if w_scale.numel() else 0
    if top > MAX_SCALE_BYTE:
        raise ValueError(f"pack_fp4_mma: an e8m0 scale byte is {top}, above {MAX_SCALE_BYTE} "
                         "(2^113), the range the kernels support")
    NT, KC = N // 16, K // 128
    words = torch.empty(E, NT, KC, 32, 8, dtype=torch.int32, device=w.device)
    # nibble q = 4 bb + 2 rh + a of a word (a: column + a, bb: + 2 bb, rh: row + 8 rh) goes to
    # register p = rh + 2 bb, half a: its e1 e0 m bits at MAG_BIT[p] + 16 a, its sign at SIGN_BIT[p] + 16 a
    mag_at, sign_at = _nibble_bits(w.device)
    for e0 in range(0, E, experts_per_step):
        blk = w[e0:e0 + experts_per_step].to(torch.int64)
        codes = torch.stack((blk & 15, blk >> 4), dim=-1).reshape(-1, N, K)  # [e, N, K]
        # rows = 16 tile + 8 rh + g; K = 128 c + 32 G + 8 t + 4 h + 2 bb + a
        c = codes.reshape(-1, NT, 2, 8, KC, 4, 4, 2, 2, 2)
        # -> [e, tile, chunk, g, t, G, h, bb, rh, a]
        c = c.permute(0, 1, 4, 3, 6, 5, 7, 8, 2, 9).reshape(-1, NT, KC, 32, 8, 8)
        word = (((c & 7) << mag_at) | ((c >> 3) << sign_at)).sum(dim=-1)  # disjoint bits, < 2^32
        words[e0:e0 + experts_per_step] = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    biased = w_scale + SCALE_BIAS  # the kernel's 2^14 (fp16 of value x 2^-14), <= 254 by the check
    scales = (biased.reshape(E, NT, 16, KC, 4).permute(0, 1, 3, 2, 4).contiguous()
              .view(torch.int32).reshape(E, NT, KC, 16))
    return Fp4MmaPack(words, scales, N, K)


def unpack_fp4_mma(pack: Fp4MmaPack, experts_per_step: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``pack_fp4_mma``: the release layout (uint8 ``[E, N, K/2]`` nibbles, uint8
    e8m0 ``[E, N, K/32]``) back from a pack, e.g. to check packed weights against the torch spec."""
    E = pack.words.shape[0]
    N, K = pack.n, pack.k
    NT, KC = N // 16, K // 128
    dev = pack.words.device
    mag_at, sign_at = _nibble_bits(dev)
    w = torch.empty(E, N, K // 2, dtype=torch.uint8, device=dev)
    for e0 in range(0, E, experts_per_step):
        words = pack.words[e0:e0 + experts_per_step].to(torch.int64)[..., None] & 0xFFFFFFFF
        c = ((words >> mag_at) & 7) | (((words >> sign_at) & 1) << 3)  # [e, NT, KC, 32, 8, 8]
        # [e, tile, chunk, g, t, G, h, bb, rh, a] -> [e, tile, rh, g, chunk, G, t, h, bb, a]
        c = c.reshape(-1, NT, KC, 8, 4, 4, 2, 2, 2, 2).permute(0, 1, 8, 3, 2, 5, 4, 6, 7, 9)
        c = c.reshape(-1, N, K // 2, 2)
        w[e0:e0 + experts_per_step] = (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)
    s = (pack.scales.view(torch.uint8).reshape(E, NT, KC, 16, 4) - SCALE_BIAS).permute(0, 1, 3, 2, 4)
    return w, s.reshape(E, N, K // 32).contiguous()


# ---- the kernel's arithmetic in float64, register by register (CPU check of the order) -----

def _f16_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 16-bit patterns -> their fp16 values in float64."""
    return bits.to(torch.int16).view(torch.float16).to(torch.float64)


def _a_fragment_values(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., 8] -> float64 [..., 8 words, 4 registers, 2 halves]: the fp16 values the
    kernel's ``dequant_word`` puts in A registers 0..3 (x 2^-14), its operations restated."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    m32 = 0xFFFFFFFF
    regs = [w & 0x8E008E00,
            ((w << 3) & m32) & 0x8E008E00,
            (((w << 6) & m32) & 0x0E000E00) | (((w << 1) & m32) & 0x80008000),
            (((w << 9) & m32) & 0x0E000E00) | (((w << 2) & m32) & 0x80008000)]
    return torch.stack([torch.stack((_f16_bits(r & 0xFFFF), _f16_bits(r >> 16)), dim=-1) for r in regs], dim=-2)


def _e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).to(torch.float64)


def emulate_fp4_mma(act_q: torch.Tensor, act_s: torch.Tensor, ids: torch.Tensor, pack: Fp4MmaPack,
                    row_div: int) -> torch.Tensor:
    """float64 [P, N]: what ``fp4_gemv_mma`` computes (one split), from the packed words and the
    activation bytes exactly as the kernel addresses them, with the PTX m16n8k16 fragment rules
    (A: lane 4 g + t, register r, half x -> row g + 8 (r & 1), column 2 t + x + 8 (r >> 1);
    B: register j, half x -> column 2 t + x + 8 j of activation column g). Rows of pairs with an
    invalid expert are 0."""
    E = pack.words.shape[0]
    N, K = pack.n, pack.k
    NT, KC = N // 16, K // 128
    flat = ids.reshape(-1).to(torch.int64)
    P = flat.numel()
    out = torch.zeros(P, N, dtype=torch.float64)
    acts = _e4m3_values(act_q.view(torch.uint8).cpu())
    # the A matrix of each MMA (word 2 G + h): A[row][col] = value of (lane, register, half)
    row = torch.arange(16).view(16, 1)
    col = torch.arange(16).view(1, 16)
    lane = 4 * (row % 8) + (col % 8) // 2
    reg = row // 8 + 2 * (col // 8)
    half = col % 2
    # B: MMA column (= K index within the MMA) col -> the lane's byte 4 h + 2 j + x of the group,
    # at the group's offset 8 t: byte = 8 t + 4 h + 2 j + x with t = (col % 8) // 2, j = col // 8
    b_byte_h0 = 8 * ((col % 8) // 2) + 2 * (col // 8) + col % 2  # [1, 16], add 4 h
    sbytes = pack.scales.cpu().contiguous().view(torch.uint8).reshape(E, NT, KC, 16, 4).to(torch.int64)
    for p in range(P):
        e = int(flat[p])
        if not 0 <= e < E:
            continue
        a_vals = _a_fragment_values(pack.words[e].cpu())  # [NT, KC, 32, 8, 4, 2]
        x = acts[p // row_div]
        xs = act_s[p // row_div].cpu().to(torch.float64)
        for c in range(KC):
            for G in range(4):
                group = torch.zeros(NT, 16, dtype=torch.float64)
                for h in range(2):
                    A = a_vals[:, c, lane, 2 * G + h, reg, half]  # [NT, 16, 16]
                    B = x[128 * c + 32 * G + 4 * h + b_byte_h0.view(-1)]  # [16]
                    group += A @ B
                scale = torch.pow(2.0, (sbytes[e, :, c, :, G] - 127).to(torch.float64))  # [NT, 16], x 2^14
                out[p] += (group * scale * xs[c]).reshape(N)
    return out


# ---- the GPU entry point --------------------------------------------------------------------

PREFETCH = 1  # 1 KiB weight chunks in flight per warp while one is multiplied (fp4_mma.cu); 2 and 3
# were slower on the H200 (more registers, fewer warps), docs/PERF.md


@lru_cache(maxsize=None)
def _kernel(device_index: int, prefetch: int, groups: int):
    """The NVRTC-compiled kernel for one device, prefetch distance and number of MMA column
    groups per pass (compiled once per process)."""
    with torch.cuda.device(device_index):
        return torch.cuda._compile_kernel(SOURCE.read_text(), "fp4_mma_gemv",
                                          nvcc_options=[f"-DPREFETCH={prefetch}", f"-DNB={groups}"])


class MmaConfig(NamedTuple):
    split_k: int = 1  # K splits (whole 128-deep chunks each); partials summed in split order
    prefetch: int = PREFETCH  # chunks in flight per warp (fp4_mma.cu)
    # MMA column groups of 8 pairs sharing each dequantised weight fragment (a pass covers 8 x this
    # many pairs of one expert); 1 at decode keeps the kernel at 64 registers
    groups: int = 1
    # pairs found by the CTAs themselves (decode: no routing launch; each CTA scans the ids before
    # it, so the work grows as P^2) or sorted by ``fp4_moe.route`` (one CTA per block of 8 x groups)
    routed: bool = False


def mma_splits(K: int, split_k: int) -> tuple[int, int]:
    """(128-deep chunks per split, number of splits): no empty split."""
    chunks = K // 128
    per = -(-chunks // max(1, split_k))
    return per, -(-chunks // per)


def fp4_gemv_mma(act_q: torch.Tensor, act_s: torch.Tensor, ids: torch.Tensor, pack: Fp4MmaPack,
                 row_div: int, config: MmaConfig = MmaConfig()) -> torch.Tensor:
    """fp32 partials ``[splits, P, N]`` of act . w[e]^T for every valid pair (rows of skipped
    pairs unset), as ``fp4_moe_decode.fp4_gemv``: act_q e4m3 ``[R, K]`` with 1x128 scales act_s
    fp32 ``[R, K/128]``, pair p's activation row ``p // row_div``; ids int32 / int64 ``[P]``."""
    N, K = pack.n, pack.k
    E = pack.words.shape[0]
    if act_q.device.type != "cuda":
        raise RuntimeError("fp4_gemv_mma runs on CUDA; emulate_fp4_mma is its CPU model")
    if act_q.shape[-1] != K or act_s.shape[-1] != K // 128:
        raise ValueError(f"fp4_gemv_mma: activations [R, {K}] with scales [R, {K // 128}] wanted, got "
                         f"{tuple(act_q.shape)} and {tuple(act_s.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fp4_gemv_mma: ids must be int32 or int64, got {ids.dtype}")
    act_q, act_s, ids = act_q.contiguous(), act_s.contiguous(), ids.reshape(-1).contiguous()
    P = ids.numel()
    per, splits = mma_splits(K, config.split_k)
    part = torch.empty(splits, P, N, dtype=torch.float32, device=act_q.device)
    if config.routed:
        r = route_pairs(ids, E, 8 * config.groups)
        blocks, tables = r.block_expert.numel(), (r.order, r.block_expert, r.block_row0, r.offsets)
    else:
        blocks, tables = P, (ids,) * 4  # unread
    pdl.launch_compiled(_kernel(act_q.device.index or 0, config.prefetch, config.groups),
                        (-(-N // ROWS_PER_CTA), blocks, splits), (128, 1, 1),
                        [pack.words, pack.scales, act_q.view(torch.uint8), act_s, ids, part,
                         P, E, N, K, row_div, int(ids.dtype == torch.int64), per, int(config.routed), *tables],
                        act_q.device)
    return part


# ---- the routed experts on packed weights ---------------------------------------------------

SCAN_MAX_PAIRS = 384  # up to 64 tokens of top-6: the CTAs find their pairs (no routing launch)
PART_BYTES_MAX = 512 << 20  # tokens per call are capped so that one fp32 partial buffer stays below


def pick_mma_configs(num_pairs: int) -> tuple[MmaConfig, MmaConfig]:
    """(gate-up, down) launch shapes by the H200 measurements of ``bench/probe_fp4_mma.py``
    (docs/PERF.md): K split in two at one to four tokens (more warps streaming), whole K from
    there; above SCAN_MAX_PAIRS the pairs are routed, one column group per pass (two and four
    were slower at T = 512 and 4096: more registers, fewer warps)."""
    if num_pairs > SCAN_MAX_PAIRS:
        return MmaConfig(1, PREFETCH, 1, True), MmaConfig(1, PREFETCH, 1, True)
    split = 2 if num_pairs <= 24 else 1
    return MmaConfig(split), MmaConfig(split)


class SharedFp8(NamedTuple):
    """A shared expert's FP8 projections, for ``fp4_moe_mma`` to run beside the routed ones: the
    ``[w1; w3]`` row stack ``w13`` e4m3 ``[2I, D]`` with its 128 x 128 scales, and ``w2`` ``[D, I]``."""
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor


def fp4_moe_mma(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: Fp4MmaPack,
                w2: Fp4MmaPack, limit: float, gate_up: MmaConfig | None = None,
                down: MmaConfig | None = None, shared: SharedFp8 | None = None,
                x_quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``fp4_moe``'s contract over packed weights (CUDA): x ``[T, D]`` bf16, ids ``[T, k]``,
    weights fp32 ``[T, k]`` -> ``[T, D]`` bf16. act-quant, the gate-up GEMV, SwiGLU + act-quant and
    the combine of ``fp4_moe_decode`` around the two MMA GEMVs; long inputs run in slices of
    tokens so that the partial sums stay below PART_BYTES_MAX.

    ``shared``: the shared expert too, returning ``shared(x) + routed`` as the unfused
    ``Expert.forward`` + add would (bf16 g, u; bf16 h; bf16 output; one bf16 add): it reuses the
    routed act-quant of x, its SwiGLU runs in the routed kernel without routing (and quantises h
    for w2 itself) and its down partials are summed in the routed combine: five launches
    fewer than the shared expert alone (act-quant twice, split sums twice, the SwiGLU's torch ops).

    ``x_quant``: ``act_quant_fp8(x)`` when the caller has it (``moe_gate(quantize=True)``), else
    computed here.

    From ``fp4_moe_prefill.PREFILL_MIN_TOKENS`` tokens (no shared expert, no explicit configs,
    outside a graph capture) the experts run as bf16 grouped GEMMs instead (``fp4_moe_prefill``)."""
    T, k = ids.shape
    E = w13.words.shape[0]
    if shared is None and gate_up is None and down is None and fp4_moe_prefill.applies(T):
        return fp4_moe_prefill.fp4_moe_prefill(x, ids, weights, w13, w2, limit)  # bf16 grouped GEMMs
    per_call = max(1, PART_BYTES_MAX // (4 * k * max(w13.n, w2.n)))
    if T > per_call:
        return torch.cat([fp4_moe_mma(x[t:t + per_call], ids[t:t + per_call], weights[t:t + per_call],
                                      w13, w2, limit, gate_up, down, shared,
                                      None if x_quant is None else (x_quant[0][t:t + per_call], x_quant[1][t:t + per_call]))
                          for t in range(0, T, per_call)])
    picked = pick_mma_configs(T * k)
    gate_up, down = gate_up or picked[0], down or picked[1]
    flat = ids.reshape(-1).contiguous()
    xq, xs = act_quant_fp8(x) if x_quant is None else x_quant
    sh = None
    if shared is not None:    # its three launches beside the routed ones (side_stream.SHARED_EXPERT)
        branch = SideBranch(x.device, side_stream.SHARED_EXPERT)
        with branch:
            sp = fp8_block_gemm_partials(xq, xs, shared.w13, shared.w13_scale)
            shq, shs = swiglu_quant(sp, None, None, 0, limit)
            sh = fp8_block_gemm_partials(shq, shs, shared.w2, shared.w2_scale)
    part = fp4_gemv_mma(xq, xs, flat, w13, k, gate_up)
    hq, hs = swiglu_quant(part, flat, weights.reshape(-1).contiguous(), E, limit)
    part = fp4_gemv_mma(hq, hs, flat, w2, 1, down)
    if shared is not None:
        branch.join()    # xq, xs (the branch's inputs) are still referenced here
    return combine_splits(part, ids.contiguous(), E, sh)
