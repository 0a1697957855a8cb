"""The MoE gate of a decode step in two launches: scores, then the top-k and routing weights.

``model.Gate.forward`` is ~14 small torch launches per layer (an fp32 copy of the gate weight,
the linear, softplus, sqrt, the bias, top-k, a gather, the sum and the scaling); at decode sizes
they cost a third of the whole bf16 MoE layer on an H200 (bench/probe_moe_bf16.py). Here:

1. **scores** (grid: tokens x ``E / BLOCK_E``): ``s = sqrt(softplus(x . W_e))`` in fp32 for a block
   of experts, x and W read once; ``BLOCK_E`` (``scores_block_e``) shrinks at few tokens so that
   the launch still covers the SMs (one token, 256 experts: one expert row per program); softplus
   as torch's (``x`` past 20, else ``log(1 + e^x)``, the log taken as ``y - y^2 / 2`` for
   ``y = e^-|x| < 1e-4`` where ``1 + y`` would round away y);
2. **select** (grid: tokens): top-k of ``s + bias`` by k rounds of an argmax (the lowest index
   wins a tie), or the hash-routed layer's ``tid2eid[token]``; weights ``s`` of the chosen,
   divided by their sum (added in choice order) and times the routed scaling factor.

Same formula as the torch path; the fp32 dot's summation order differs (a near-tie of two
experts' scores may then pick the other one, as any change of GEMM would).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import native, quant_block_e4m3
from dsv4_backend.kernels.fp8_gemm import _num_sms
from dsv4_backend.kernels import pdl
from dsv4_backend.kernels.pdl import wait as pdl_wait


@triton.jit
def _scores_kernel(x_ptr, w_ptr, s_ptr, q_ptr, qs_ptr, E, D, x_sr, w_sr, E_BLOCKS, NB,
                   BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, NATIVE: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    if QUANT:
        if tl.program_id(1) >= E_BLOCKS:    # the programs past the experts' round x to e4m3, one 128-block each
            _act_quant_block(x_ptr, x_sr, q_ptr, qs_ptr, D, NB, tl.program_id(1) - E_BLOCKS, NATIVE)
        else:
            _scores_block(x_ptr, w_ptr, s_ptr, E, D, x_sr, w_sr, BLOCK_E, BLOCK_D)
    else:
        _scores_block(x_ptr, w_ptr, s_ptr, E, D, x_sr, w_sr, BLOCK_E, BLOCK_D)


@triton.jit
def _act_quant_block(x_ptr, x_sr, q_ptr, qs_ptr, D, NB, kb, NATIVE: tl.constexpr):
    """``act_quant_fp8`` of token t's 128-block kb: the same rounding, one row of its [8, 128] tile."""
    t = tl.program_id(0).to(tl.int64)
    cols = kb * 128 + tl.arange(0, 128)
    ok = cols < D
    x = tl.load(x_ptr + t * x_sr + cols, mask=ok, other=0.0).to(tl.float32)
    codes, scale = quant_block_e4m3(tl.expand_dims(x, 0), NATIVE)
    tl.store(q_ptr + t * D + cols, tl.reshape(codes, [128]), mask=ok)
    tl.store(qs_ptr + t * NB + kb + tl.arange(0, 1), scale)


@triton.jit
def _scores_block(x_ptr, w_ptr, s_ptr, E, D, x_sr, w_sr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < E
    dd = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_E, BLOCK_D), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dm = (d0 + dd) < D
        xv = tl.load(x_ptr + t * x_sr + d0 + dd, mask=dm, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + e.to(tl.int64)[:, None] * w_sr + (d0 + dd)[None, :],
                     mask=emask[:, None] & dm[None, :], other=0.0).to(tl.float32)
        acc += wv * xv[None, :]
    z = tl.sum(acc, axis=1)
    y = tl.exp(-tl.abs(z))
    lp = tl.where(y < 1e-4, y - 0.5 * y * y, tl.log(1.0 + y))
    sp = tl.where(z > 20.0, z, tl.maximum(z, 0.0) + lp)
    tl.store(s_ptr + t * E + e, tl.sqrt(sp), mask=emask)


@triton.jit
def _select_kernel(s_ptr, bias_ptr, tid_ptr, tok_ptr, ids_ptr, wts_ptr, E, scale, TOPK: tl.constexpr,
                   KP: tl.constexpr, EP: tl.constexpr, HASH: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    emask = e < E
    s = tl.load(s_ptr + t * E + e, mask=emask, other=0.0)
    kk = tl.arange(0, KP)
    kmask = kk < TOPK
    chosen = tl.zeros((KP,), dtype=tl.int32)
    if HASH:
        tok = tl.load(tok_ptr + t)
        chosen = tl.load(tid_ptr + tok * TOPK + kk, mask=kmask, other=0).to(tl.int32)
    else:
        key = tl.where(emask, s + tl.load(bias_ptr + e, mask=emask, other=0.0).to(tl.float32), -float("inf"))
        for j in tl.static_range(TOPK):
            best = tl.argmax(key, axis=0)
            chosen = tl.where(kk == j, best, chosen)
            key = tl.where(e == best, -float("inf"), key)
    # the chosen scores, in choice order (a gather from the score row)
    w = tl.zeros((KP,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        cj = tl.sum(tl.where(kk == j, chosen, 0), axis=0)
        sj = tl.sum(tl.where(e == cj, s, 0.0), axis=0)
        w = tl.where(kk == j, sj, w)
    total = 0.0
    for j in tl.static_range(TOPK):
        total += tl.sum(tl.where(kk == j, w, 0.0), axis=0)
    tl.store(ids_ptr + t * TOPK + kk, chosen.to(tl.int64), mask=kmask)
    tl.store(wts_ptr + t * TOPK + kk, w / total * scale, mask=kmask)


def scores_block_e(T: int, E: int, num_sms: int) -> int:
    """Experts per scores program: 8 (each program's x chunk serves eight weight rows) while the
    launch has two programs per SM, fewer when it would not (at one token, 8 rows a program put
    32 programs on 132 SMs: each read 64 KB of weights in turn)."""
    block = 8
    while block > 1 and T * triton.cdiv(E, block) < 2 * num_sms:
        block //= 2
    return min(block, triton.next_power_of_2(E))


def moe_gate(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], topk: int, scale: float,
             tid2eid: Optional[torch.Tensor] = None, input_ids: Optional[torch.Tensor] = None,
             block_e: Optional[int] = None, quantize: bool = False) -> tuple[torch.Tensor, ...]:
    """Expert ids int64 [T, topk] and routing weights fp32 [T, topk] of ``x [T, D]`` against the
    gate ``weight [E, D]``: top-k of ``sqrt(softplus(x W^T)) + bias``, or, with ``tid2eid [V,
    topk]`` (a hash-routed layer, ``bias`` None), ``tid2eid[input_ids]``. ``block_e``: experts per
    scores program (None: ``scores_block_e``). ``quantize``: also ``act_quant_fp8(x)`` (the experts'
    input, bit for bit), from extra programs of the scores launch: returns (ids, w, xq, xs)."""
    T, D = x.shape
    E = weight.shape[0]
    if weight.shape[1] != D or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"moe_gate: x {tuple(x.shape)} and weight {tuple(weight.shape)} must share D, rows contiguous")
    if (bias is None) == (tid2eid is None):
        raise ValueError("moe_gate: give bias (scored routing) or tid2eid (hash routing), not both / neither")
    if not 1 <= topk <= E:
        raise ValueError(f"moe_gate: topk {topk} must be in 1 .. E = {E}")
    s = torch.empty(T, E, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, topk, dtype=torch.int64, device=x.device)
    w = torch.empty(T, topk, dtype=torch.float32, device=x.device)
    nb = triton.cdiv(D, 128)
    quant = (torch.empty(T, D, dtype=torch.float8_e4m3fn, device=x.device),
             torch.empty(T, nb, dtype=torch.float32, device=x.device)) if quantize else ()
    if T == 0:
        return (ids, w) + quant
    if block_e is None:
        block_e = scores_block_e(T, E, _num_sms(x.device))
    e_blocks = triton.cdiv(E, block_e)
    q_args = (quant[0].view(torch.uint8), quant[1]) if quantize else (s, s)    # (unread without quantize)
    _scores_kernel[(T, e_blocks + (nb if quantize else 0))](
        x, weight, s, *q_args, E, D, x.stride(0), weight.stride(0), e_blocks, nb,
        BLOCK_E=block_e, BLOCK_D=512, QUANT=quantize, NATIVE=native(), num_warps=4, **pdl.args(x.device))
    hashed = tid2eid is not None
    dummy = s
    _select_kernel[(T,)](s, bias if bias is not None else dummy,
                         tid2eid.contiguous() if hashed else dummy,
                         input_ids.contiguous() if hashed else dummy, ids, w, E, float(scale),
                         TOPK=topk, KP=triton.next_power_of_2(topk), EP=triton.next_power_of_2(E), HASH=hashed,
                         num_warps=4, **pdl.args(s.device))
    return (ids, w) + quant
