"""mHC (manifold-constrained hyper-connection) kernels: the Sinkhorn mix, collapse and expand.

The torch code in ``dsv4_backend/model.py`` (``hc_sinkhorn``, ``hc_collapse``, ``hc_expand``)
is the reference; these kernels do the same arithmetic in fp32 registers so that one launch
replaces the ~90 small torch ops of a Sinkhorn mix (and the handful of a collapse / expand).

- ``mhc_mix``: mix logits ``m [T, hc * (2 + hc)]`` (after the ``fn`` matmul and the rsqrt
  scaling) plus ``scale [3]`` and ``base [hc * (2 + hc)]`` -> pre, post ``[T, hc]`` and the
  doubly-stochastic ``C [T, hc, hc]``; one program per block of tokens, hc padded to a power
  of two and masked.
- ``mhc_mix_from_streams``: the same from the streams ``X [T, hc, D]`` and ``fn`` in two launches
  (the model's path at decode sizes): a split-K kernel writes each chunk's partial dots with
  fn's rows and partial sum of squares, in fp32 from X's own dtype (a broadcast product below
  16 tokens, an fp32 ``tl.dot`` from 16), and a finalize sums the partials per token, applies the
  rsqrt and does what ``mhc_mix`` does. Split-K because at a few tokens the work is streaming fn
  (1.5 MB at Flash): K / chunk programs share it, where one per token would leave most SMs idle.
  ``mhc_head_pre``: the hc_head's pre gate by the same launches.
- ``mhc_collapse``: ``y[t] = sum_j pre[t, j] X[t, j]`` (fp32 out).
- ``mhc_expand``: ``X'[t, k] = post[t, k] f[t] + sum_j C[t, j, k] X[t, j]`` (X's dtype out).
- ``mhc_expand_partials``: the expand and the next mix's split-K partials of the streams it
  writes in one launch, the partials then finalized by ``mhc_mix_finalize`` (a sub-layer
  boundary in three launches where ``mhc_expand`` + ``mhc_mix_from_streams`` take four).
- ``mhc_collapse_norm``: ``RMSNorm(sum_j pre[t, j] X[t, j]) * weight``, a sub-layer's input
  (collapse and block norm in one launch).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import check_device, native, round_bf16
from dsv4_backend.kernels import pdl
from dsv4_backend.kernels.pdl import wait as pdl_wait


class MixWeights(NamedTuple):
    pre: torch.Tensor   # fp32 [T, hc]
    post: torch.Tensor  # fp32 [T, hc]
    C: torch.Tensor     # fp32 [T, hc, hc], C[t, j, k]: stream j -> stream k


@triton.jit
def _gate(a, s, b_ptr, j, j_ok):
    """``sigmoid(a s + b)`` for logits ``a [BT, HCP]`` (padded entries 0) and the HCP biases at b_ptr."""
    b = tl.load(b_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
    return tl.sigmoid(a * s + b[None, :])


@triton.jit
def _sinkhorn(x, s, b_ptr, j, j_ok, eps, HC: tl.constexpr, ITERS: tl.constexpr):
    """The doubly-stochastic C [BT, HCP (j), HCP (k)] from its logits x (padded entries 0): padded
    rows get finite logits, padded columns -inf, and both are zeroed after the softmax so they
    never enter a row or column sum."""
    col = j[:, None] * HC + j[None, :]                                     # [HCP, HCP]
    ok_jk = j_ok[:, None] & j_ok[None, :]
    bc = tl.load(b_ptr + col, mask=ok_jk, other=0.0).to(tl.float32)
    x = x * s + bc[None, :, :]
    x = tl.where(j_ok[None, None, :], x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=2)[:, :, None])
    C = e / tl.sum(e, axis=2)[:, :, None] + eps
    C = tl.where(ok_jk[None, :, :], C, 0.0)
    C = C / (tl.sum(C, axis=1)[:, None, :] + eps)
    for _ in range(ITERS - 1):
        C = C / (tl.sum(C, axis=2)[:, :, None] + eps)
        C = C / (tl.sum(C, axis=1)[:, None, :] + eps)
    return C


@triton.jit
def _store_pre(a_pre, t64, t_ok, scale_ptr, base_ptr, pre_ptr, eps, HC: tl.constexpr, HCP: tl.constexpr):
    """``pre = sigmoid(a scale[0] + base[:hc]) + eps`` of tokens t64 [BT] from their logits a_pre [BT, HCP]."""
    j = tl.arange(0, HCP)
    j_ok = j < HC
    pre = _gate(a_pre, tl.load(scale_ptr).to(tl.float32), base_ptr, j, j_ok) + eps
    tl.store(pre_ptr + t64[:, None] * HC + j[None, :], pre, mask=t_ok[:, None] & j_ok[None, :])


@triton.jit
def _mix_store(a_pre, a_post, x, t64, t_ok, scale_ptr, base_ptr, pre_ptr, post_ptr, c_ptr, eps,
               HC: tl.constexpr, HCP: tl.constexpr, ITERS: tl.constexpr):
    """pre, post and C of tokens t64 [BT] from their logits a_pre, a_post [BT, HCP], x [BT, HCP, HCP]."""
    _store_pre(a_pre, t64, t_ok, scale_ptr, base_ptr, pre_ptr, eps, HC, HCP)
    j = tl.arange(0, HCP)
    j_ok = j < HC
    post = 2.0 * _gate(a_post, tl.load(scale_ptr + 1).to(tl.float32), base_ptr + HC, j, j_ok)
    tl.store(post_ptr + t64[:, None] * HC + j[None, :], post, mask=t_ok[:, None] & j_ok[None, :])
    C = _sinkhorn(x, tl.load(scale_ptr + 2).to(tl.float32), base_ptr + 2 * HC, j, j_ok, eps, HC, ITERS)
    ok3 = t_ok[:, None, None] & (j_ok[:, None] & j_ok[None, :])[None, :, :]
    out3 = t64[:, None, None] * (HC * HC) + (j[:, None] * HC + j[None, :])[None, :, :]
    tl.store(c_ptr + out3, C, mask=ok3)


@triton.jit
def _mix_kernel(m_ptr, m_stride, scale_ptr, base_ptr, pre_ptr, post_ptr, c_ptr, T, eps,
                HC: tl.constexpr, HCP: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    j = tl.arange(0, HCP)
    j_ok = j < HC
    row = m_ptr + t64[:, None] * m_stride                                   # [BT, 1]
    ok2 = t_ok[:, None] & j_ok[None, :]
    a_pre = tl.load(row + j[None, :], mask=ok2, other=0.0).to(tl.float32)
    a_post = tl.load(row + HC + j[None, :], mask=ok2, other=0.0).to(tl.float32)
    col = 2 * HC + j[:, None] * HC + j[None, :]                            # [HCP, HCP]
    ok3 = t_ok[:, None, None] & (j_ok[:, None] & j_ok[None, :])[None, :, :]
    x = tl.load(row[:, :, None] + col[None, :, :], mask=ok3, other=0.0).to(tl.float32)
    _mix_store(a_pre, a_post, x, t64, t_ok, scale_ptr, base_ptr, pre_ptr, post_ptr, c_ptr, eps, HC, HCP, ITERS)


def _empty_mix(T: int, hc: int, device: torch.device) -> MixWeights:
    return MixWeights(torch.empty(T, hc, dtype=torch.float32, device=device),
                      torch.empty(T, hc, dtype=torch.float32, device=device),
                      torch.empty(T, hc, hc, dtype=torch.float32, device=device))


def _check_mix_params(scale: torch.Tensor, base: torch.Tensor, n_mix: int, sinkhorn_iters: int, what: str) -> None:
    if scale.numel() != 3 or base.numel() != n_mix:
        raise ValueError(f"{what}: scale must have 3 and base {n_mix} elements, "
                         f"got {scale.numel()} and {base.numel()}")
    if sinkhorn_iters < 1:
        raise ValueError(f"{what}: sinkhorn_iters must be >= 1, got {sinkhorn_iters}")


def mhc_mix(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
            sinkhorn_iters: int, eps: float, block_t: int = 16) -> MixWeights:
    """Sinkhorn mix weights from the scaled mix logits (fp32 arithmetic whatever m's dtype).

    m: [T, hc * (2 + hc)] (last dim contiguous); scale: [3]; base: [hc * (2 + hc)].
    """
    n_mix = hc * (2 + hc)
    if m.dim() != 2 or m.shape[1] != n_mix or m.stride(1) != 1:
        raise ValueError(f"mhc_mix: m must be [T, {n_mix}] with a contiguous last dim, "
                         f"got {tuple(m.shape)} strides {m.stride()}")
    _check_mix_params(scale, base, n_mix, sinkhorn_iters, "mhc_mix")
    check_device(m, scale, base)
    T = m.shape[0]
    pre, post, C = _empty_mix(T, hc, m.device)
    if T:
        _mix_kernel[(triton.cdiv(T, block_t),)](
            m, m.stride(0), scale.contiguous(), base.contiguous(), pre, post, C, T, float(eps),
            HC=hc, HCP=triton.next_power_of_2(hc), ITERS=sinkhorn_iters, BLOCK_T=block_t)
    return MixWeights(pre, post, C)


# ---- mix weights straight from the streams (decode sizes) ------------------------------------

def _check_streams(X: torch.Tensor, what: str) -> None:
    if X.dim() != 3 or not X.is_contiguous():
        raise ValueError(f"{what}: streams must be a contiguous [T, hc, D], got "
                         f"{tuple(X.shape)} strides {X.stride()}")


@triton.jit
def _store_partials(x, w, part_ptr, t64, t_ok, s, S, n, n_ok, N: tl.constexpr, DOT: tl.constexpr):
    """Chunk s's partials of tokens t64 [BT]: the dots of x [BT, CHUNK] (fp32) with fn's tile w
    [NP, CHUNK], then the sum of squares, at part[t, s]. DOT: one fp32 tl.dot (IEEE products and
    sums, BT >= 16), else a broadcast product summed by tl.sum; either sums in some order."""
    if DOT:
        dots = tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        dots = tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    out = part_ptr + (t64 * S + s) * (N + 1)                                 # [BT]
    tl.store(out[:, None] + n[None, :], dots, mask=t_ok[:, None] & n_ok[None, :])
    tl.store(out + N, tl.sum(x * x, axis=1), mask=t_ok)


@triton.jit
def _mix_partial_kernel(x_ptr, fn_ptr, part_ptr, T, K, S, N: tl.constexpr, NP: tl.constexpr,
                        CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    # program (i, s): chunk s of K for tokens [i BLOCK_T, (i + 1) BLOCK_T); fn's tile is read once for them
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    s = tl.program_id(1)
    k = s * CHUNK + tl.arange(0, CHUNK)
    k_ok = k < K
    n = tl.arange(0, NP)
    n_ok = n < N
    x = tl.load(x_ptr + t64[:, None] * K + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)                                   # [BT, CHUNK]
    w = tl.load(fn_ptr + n[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [NP, CHUNK]
    _store_partials(x, w, part_ptr, t64, t_ok, s, S, n, n_ok, N, DOT)


@triton.jit
def _mix_from_partials_kernel(part_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, c_ptr, T, S, K, eps, rms_eps,
                              N: tl.constexpr, HC: tl.constexpr, HCP: tl.constexpr, ITERS: tl.constexpr,
                              SP: tl.constexpr, PRE_ONLY: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    # one program per token: its S partials are loaded as one [SP, ...] tile and summed by tl.sum,
    # a fixed order; then m = dot * rsqrt(ssq / K + rms_eps) and what _mix_kernel does
    t64 = (tl.program_id(0) + tl.zeros([1], dtype=tl.int32)).to(tl.int64)  # [1]
    t_ok = t64 < T
    s = tl.arange(0, SP)
    s_ok = s < S
    srow = part_ptr + t64 * S * (N + 1) + s * (N + 1)                      # [SP]
    r = tl.rsqrt(tl.sum(tl.load(srow + N, mask=s_ok, other=0.0), axis=0) / K + rms_eps)
    j = tl.arange(0, HCP)
    j_ok = j < HC
    ok2 = s_ok[:, None] & j_ok[None, :]
    a_pre = tl.sum(tl.load(srow[:, None] + j[None, :], mask=ok2, other=0.0), axis=0, keep_dims=True) * r
    if PRE_ONLY:
        _store_pre(a_pre, t64, t_ok, scale_ptr, base_ptr, pre_ptr, eps, HC, HCP)
    else:
        a_post = tl.sum(tl.load(srow[:, None] + HC + j[None, :], mask=ok2, other=0.0), axis=0, keep_dims=True) * r
        col = 2 * HC + j[:, None] * HC + j[None, :]                        # [HCP, HCP]
        ok3 = s_ok[:, None, None] & (j_ok[:, None] & j_ok[None, :])[None, :, :]
        x = tl.sum(tl.load(srow[:, None, None] + col[None, :, :], mask=ok3, other=0.0), axis=0, keep_dims=True) * r
        _mix_store(a_pre, a_post, x, t64, t_ok, scale_ptr, base_ptr, pre_ptr, post_ptr, c_ptr, eps, HC, HCP, ITERS)


def _check_stream_logits(X: torch.Tensor, fn: torch.Tensor, n: int, chunk: int, what: str) -> None:
    _check_streams(X, what)
    if X.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{what}: streams must be float32, bfloat16 or float16, got {X.dtype}")
    K = X.shape[1] * X.shape[2]
    if fn.shape != (n, K) or fn.dtype != torch.float32 or not fn.is_contiguous():
        raise ValueError(f"{what}: fn must be a contiguous float32 [{n}, {K}], got {fn.dtype} "
                         f"{tuple(fn.shape)} strides {fn.stride()}")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"{what}: chunk must be a power of two >= 16, got {chunk}")


class MixLaunch(NamedTuple):
    chunk: int         # K values a partial program sums
    block_t: int       # tokens a partial program
    num_warps: int     # the partial program's warps
    dot: bool          # the chunk's dots as one fp32 tl.dot (block_t >= 16) or a broadcast product
    finalize_warps: int


# From this many tokens the partials are tl.dot products of 16 (32 past 32 tokens) tokens x 64
# values. On the H200 (bench/probe_mhc.py --parts sublayer, Flash's streams, graph replays) the
# split-K partials at 17 / 64 tokens took 7.3 / 12.7 us against 9.9 / 24.8 us for the broadcast
# product; below 16 tokens the broadcast product is as fast (3.0 against 4.5 us at one token). The
# finalize on one warp was 0.85-0.95 us faster than on four at every token count (its Sinkhorn's
# reductions stay inside a warp).
MIX_DOT_MIN_TOKENS = 16


def mix_launch(T: int, N: int, chunk: int | None = None, block_t: int | None = None,
               num_warps: int | None = None, dot: bool | None = None,
               finalize_warps: int | None = None) -> MixLaunch:
    """The launch of ``mhc_mix_from_streams`` for T tokens of N mix logits; None: the default."""
    if dot is None:
        dot = T >= MIX_DOT_MIN_TOKENS
    if chunk is None:
        chunk = 64 if dot else 128
    if block_t is None:
        block_t = (16 if T <= 32 else 32) if dot else min(4, triton.next_power_of_2(T))
    if dot and block_t < 16:
        raise ValueError(f"mhc mix: the tl.dot partials need block_t >= 16, got {block_t}")
    if num_warps is None:   # the broadcast product: 2 warps past 4 tokens (15.1 against 20.7 us at T = 17)
        if dot:
            num_warps = 2 if block_t <= 16 else 4
        else:
            num_warps = 2 if T > 4 else (8 if block_t * triton.next_power_of_2(N) * chunk >= 16384 else 4)
    return MixLaunch(chunk, block_t, num_warps, dot, finalize_warps or 1)


def _launch_partials(X, fn, launch: MixLaunch) -> torch.Tensor:
    """The split-K partials [T, S, N + 1] (per (t, s): N dots, then the sum of squares)."""
    T = X.shape[0]
    N, K = fn.shape
    S = triton.cdiv(K, launch.chunk)
    part = torch.empty(T, S, N + 1, dtype=torch.float32, device=X.device)
    _mix_partial_kernel[(triton.cdiv(T, launch.block_t), S)](
        X, fn, part, T, K, S, N=N, NP=triton.next_power_of_2(N), CHUNK=launch.chunk, BLOCK_T=launch.block_t,
        DOT=launch.dot, num_warps=launch.num_warps, **pdl.args(X.device))
    return part


def _launch_from_streams(X, fn, scale, base, pre, post, C, hc_eps, rms_eps, iters, pre_only, launch: MixLaunch):
    part = _launch_partials(X, fn, launch)
    _launch_finalize(part, X.shape[1] * X.shape[2], scale, base, pre, post, C, hc_eps, rms_eps, iters, pre_only,
                     launch.finalize_warps)


def _launch_finalize(part, K, scale, base, pre, post, C, hc_eps, rms_eps, iters, pre_only, num_warps):
    T, S, N = part.shape[0], part.shape[1], part.shape[2] - 1
    hc = pre.shape[1]
    _mix_from_partials_kernel[(T,)](
        part, scale.contiguous(), base.contiguous(), pre, post, C, T, S, K, float(hc_eps), float(rms_eps),
        N=N, HC=hc, HCP=triton.next_power_of_2(hc), ITERS=iters, SP=triton.next_power_of_2(S),
        PRE_ONLY=pre_only, num_warps=num_warps, **pdl.args(part.device))


def mhc_mix_from_streams(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                         sinkhorn_iters: int, hc_eps: float, rms_eps: float, chunk: int | None = None,
                         block_t: int | None = None, num_warps: int | None = None, dot: bool | None = None,
                         finalize_warps: int | None = None) -> MixWeights:
    """``mhc_mix`` of ``model.hc_mix_logits(X, fn)`` in two launches, without the fp32 copy of X:
    split-K partial dots and sums of squares of each ``chunk`` of ``X[t]`` (flattened to
    ``K = hc * D``), then a finalize, one program per token, that sums them, scales by
    ``rsqrt(ssq / K + rms_eps)`` and runs the gates and the Sinkhorn. ``K / chunk`` programs per
    block of tokens stream fn (128 at Flash's K = 16384 below 16 tokens: one per SM at T = 1).

    X: contiguous [T, hc, D] (float32 / bfloat16 / float16); fn: contiguous float32
    [hc * (2 + hc), hc * D]; scale: [3]; base: [hc * (2 + hc)]. ``chunk``, ``block_t`` (tokens a
    partial program), ``num_warps``, ``dot`` (tl.dot partials) and ``finalize_warps`` override
    the launch ``mix_launch`` picks (bench/probe_mhc.py)."""
    n_mix = hc * (2 + hc)
    if X.dim() != 3 or X.shape[1] != hc:
        raise ValueError(f"mhc_mix_from_streams: streams must be [T, {hc}, D], got {tuple(X.shape)}")
    launch = mix_launch(X.shape[0], n_mix, chunk, block_t, num_warps, dot, finalize_warps)
    _check_stream_logits(X, fn, n_mix, launch.chunk, "mhc_mix_from_streams")
    _check_mix_params(scale, base, n_mix, sinkhorn_iters, "mhc_mix_from_streams")
    check_device(X, fn, scale, base)
    T = X.shape[0]
    pre, post, C = _empty_mix(T, hc, X.device)
    if T:
        _launch_from_streams(X, fn, scale, base, pre, post, C, hc_eps, rms_eps, sinkhorn_iters, False, launch)
    return MixWeights(pre, post, C)


def mhc_mix_finalize(part: torch.Tensor, K: int, scale: torch.Tensor, base: torch.Tensor, hc: int,
                     sinkhorn_iters: int, hc_eps: float, rms_eps: float) -> MixWeights:
    """The second launch of ``mhc_mix_from_streams`` alone: the mix weights from split-K partials
    ``part`` fp32 [T, S, hc (2 + hc) + 1] of streams of ``K = hc D`` values (``mhc_expand_partials``)."""
    n_mix = hc * (2 + hc)
    if part.dim() != 3 or part.shape[2] != n_mix + 1 or part.dtype != torch.float32 or not part.is_contiguous():
        raise ValueError(f"mhc_mix_finalize: want contiguous fp32 partials [T, S, {n_mix + 1}], "
                         f"got {part.dtype} {tuple(part.shape)}")
    _check_mix_params(scale, base, n_mix, sinkhorn_iters, "mhc_mix_finalize")
    check_device(part, scale, base)
    T = part.shape[0]
    pre, post, C = _empty_mix(T, hc, part.device)
    if T:
        _launch_finalize(part, K, scale, base, pre, post, C, hc_eps, rms_eps, sinkhorn_iters, False,
                         mix_launch(T, n_mix).finalize_warps)
    return MixWeights(pre, post, C)


def mhc_head_pre(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
                 rms_eps: float, chunk: int = 128) -> torch.Tensor:
    """The hc_head's ``pre = sigmoid(m scale + base) + hc_eps`` with ``m`` the RMS-scaled
    ``X @ fn.T`` (``model.hc_head_collapse``), by the same two launches as
    ``mhc_mix_from_streams`` (the broadcast-product partials: hc dots are too few for tl.dot).
    X: contiguous [T, hc, D]; fn: contiguous float32 [hc, hc * D]; scale: [1]; base: [hc] -> fp32 [T, hc]."""
    hc = X.shape[1] if X.dim() == 3 else 0
    _check_stream_logits(X, fn, hc, chunk, "mhc_head_pre")
    if scale.numel() != 1 or base.numel() != hc:
        raise ValueError(f"mhc_head_pre: scale must have 1 and base {hc} elements, "
                         f"got {scale.numel()} and {base.numel()}")
    check_device(X, fn, scale, base)
    pre = torch.empty(X.shape[0], hc, dtype=torch.float32, device=X.device)
    if X.shape[0]:
        _launch_from_streams(X, fn, scale, base, pre, pre, pre, hc_eps, rms_eps, 1, True,
                             mix_launch(X.shape[0], hc, chunk, dot=False))
    return pre


# ---- collapse / expand ----------------------------------------------------------------------

@triton.jit
def _collapse_kernel(x_ptr, pre_ptr, y_ptr, D, HC: tl.constexpr, HCP: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, HCP)
    ok = (j[:, None] < HC) & (d[None, :] < D)
    x = tl.load(x_ptr + t * HC * D + j[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    p = tl.load(pre_ptr + t * HC + j, mask=j < HC, other=0.0)
    tl.store(y_ptr + t * D + d, tl.sum(p[:, None] * x, axis=0), mask=d < D)


def mhc_collapse(X: torch.Tensor, pre: torch.Tensor, block_d: int = 256) -> torch.Tensor:
    """``sum_j pre[t, j] X[t, j, :]``: X [T, hc, D] (any float dtype), pre fp32 [T, hc] -> fp32 [T, D]."""
    _check_streams(X, "mhc_collapse")
    T, hc, D = X.shape
    if pre.shape != (T, hc) or pre.dtype != torch.float32:
        raise ValueError(f"mhc_collapse: pre must be fp32 [{T}, {hc}], got {pre.dtype} {tuple(pre.shape)}")
    check_device(X, pre)
    y = torch.empty(T, D, dtype=torch.float32, device=X.device)
    if T:
        _collapse_kernel[(T, triton.cdiv(D, block_d))](
            X, pre.contiguous(), y, D, HC=hc, HCP=triton.next_power_of_2(hc), BLOCK_D=block_d)
    return y


@triton.jit
def _expand_kernel(x_ptr, f_ptr, post_ptr, c_ptr, out_ptr, D, HC: tl.constexpr,
                   HCP: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_BF16: tl.constexpr,
                   NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    j = tl.arange(0, HCP)
    j_ok = j < HC
    x = tl.load(x_ptr + t * HC * D + j[:, None] * D + d[None, :],
                mask=j_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [HCP, BLOCK_D]
    f = tl.load(f_ptr + t * D + d, mask=d_ok, other=0.0).to(tl.float32)
    for k in tl.static_range(HC):
        c = tl.load(c_ptr + t * HC * HC + j * HC + k, mask=j_ok, other=0.0)  # C[t, :, k]
        post = tl.load(post_ptr + t * HC + k)
        y = post * f + tl.sum(c[:, None] * x, axis=0)
        if ROUND_BF16:  # the interpreter truncates on the store; round to nearest even first
            y = round_bf16(y, NATIVE)
        tl.store(out_ptr + t * HC * D + k * D + d, y.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _expand_partial_kernel(x_ptr, f_ptr, post_ptr, c_ptr, out_ptr, fn_ptr, part_ptr, T, D, S,
                           HC: tl.constexpr, HCP: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                           CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, DOT: tl.constexpr,
                           ROUND_BF16: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    # program (i, s): the new streams' chunk s of K = hc D (stream k, columns d; D % CHUNK == 0) for
    # tokens [i BLOCK_T, (i + 1) BLOCK_T), as _expand_kernel computes and stores them, then the next
    # mix's partials of that chunk from the stored values, as _mix_partial_kernel computes them.
    # fn's tile is loaded first: no load may move above the store of the streams (they could alias)
    s = tl.program_id(1)
    kk = s * CHUNK + tl.arange(0, CHUNK)
    n = tl.arange(0, NP)
    n_ok = n < N
    K = HC * D
    w = tl.load(fn_ptr + n[:, None] * K + kk[None, :], mask=n_ok[:, None], other=0.0)  # [NP, CHUNK]
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    k = (s * CHUNK) // D
    d = (s * CHUNK) % D + tl.arange(0, CHUNK)
    j = tl.arange(0, HCP)
    j_ok = j < HC
    x = tl.load(x_ptr + t64[:, None, None] * K + j[None, :, None] * D + d[None, None, :],
                mask=t_ok[:, None, None] & j_ok[None, :, None], other=0.0).to(tl.float32)   # [BT, HCP, CHUNK]
    f = tl.load(f_ptr + t64[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
    c = tl.load(c_ptr + t64[:, None] * HC * HC + j[None, :] * HC + k, mask=t_ok[:, None] & j_ok[None, :],
                other=0.0)                                                    # C[t, :, k]
    post = tl.load(post_ptr + t64 * HC + k, mask=t_ok, other=0.0)
    y = post[:, None] * f + tl.sum(c[:, :, None] * x, axis=1)               # [BT, CHUNK]
    if ROUND_BF16:  # the interpreter truncates on the store; round to nearest even first
        y = round_bf16(y, NATIVE)
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t64[:, None] * K + k * D + d[None, :], y, mask=t_ok[:, None])
    x = y.to(tl.float32)                                                    # the stream as stored
    _store_partials(x, w, part_ptr, t64, t_ok, s, S, n, n_ok, N, DOT)


def _check_expand_args(X: torch.Tensor, f: torch.Tensor, post: torch.Tensor, C: torch.Tensor, what: str) -> None:
    T, hc, D = X.shape
    if f.shape != (T, D) or post.shape != (T, hc) or C.shape != (T, hc, hc):
        raise ValueError(f"{what}: shapes X {tuple(X.shape)}, f {tuple(f.shape)}, "
                         f"post {tuple(post.shape)}, C {tuple(C.shape)} do not agree")
    if post.dtype != torch.float32 or C.dtype != torch.float32:
        raise ValueError(f"{what}: post and C must be fp32, got {post.dtype}, {C.dtype}")


def expand_partials_apply(X: torch.Tensor, fn: torch.Tensor) -> bool:
    """Whether a boundary's expand should compute the next mix's partials (``mhc_expand_partials``)
    for streams X [T, hc, D] and that mix's fn: below the tl.dot partials' token count (on the
    H100 the fusion was measured at 1-15 tokens only, docs/PERF.md session 19), with each split-K
    chunk inside one stream."""
    T = X.shape[0]
    return X.dim() == 3 and T < MIX_DOT_MIN_TOKENS and X.shape[2] % mix_launch(T, fn.shape[0]).chunk == 0


def mhc_expand_partials(X: torch.Tensor, f: torch.Tensor, post: torch.Tensor, C: torch.Tensor,
                        fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``mhc_expand(X, f, post, C)`` and the next mix's split-K partials of the new streams (what
    ``mhc_mix_from_streams`` launches first, from the same stored values, in the same order) in
    one launch: the program that computes a chunk of the new streams also multiplies it with fn's
    columns. Returns (new streams [T, hc, D] in X's dtype, partials fp32 [T, S, N + 1]) for
    ``mhc_mix_finalize``. fn: contiguous float32 [N, hc D]; D a multiple of the launch's
    chunk (``expand_partials_apply``)."""
    _check_streams(X, "mhc_expand_partials")
    T, hc, D = X.shape
    N = fn.shape[0]
    launch = mix_launch(T, N)
    _check_stream_logits(X, fn, N, launch.chunk, "mhc_expand_partials")
    if D % launch.chunk:
        raise ValueError(f"mhc_expand_partials: D={D} must be a multiple of the chunk {launch.chunk}")
    _check_expand_args(X, f, post, C, "mhc_expand_partials")
    check_device(X, f, post, C, fn)
    S = hc * D // launch.chunk
    out = torch.empty_like(X)
    part = torch.empty(T, S, N + 1, dtype=torch.float32, device=X.device)
    if T:
        _expand_partial_kernel[(triton.cdiv(T, launch.block_t), S)](
            X, f.contiguous(), post.contiguous(), C.contiguous(), out, fn, part, T, D, S,
            HC=hc, HCP=triton.next_power_of_2(hc), N=N, NP=triton.next_power_of_2(N), CHUNK=launch.chunk,
            BLOCK_T=launch.block_t, DOT=launch.dot, ROUND_BF16=X.dtype == torch.bfloat16 and not native(),
            NATIVE=native(), num_warps=launch.num_warps, **pdl.args(X.device))
    return out, part


def mhc_expand(X: torch.Tensor, f: torch.Tensor, post: torch.Tensor, C: torch.Tensor,
               block_d: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """New streams ``post[t, k] f[t] + sum_j C[t, j, k] X[t, j]`` in fp32, stored in X's dtype.

    X: [T, hc, D]; f: [T, D]; post: fp32 [T, hc]; C: fp32 [T, hc, hc] -> [T, hc, D].
    ``block_d``: D values a program (None: up to 1,024) and ``num_warps`` (None: 4). On the H200
    (bench/probe_mhc.py, Flash's four streams of 4,096, 20 calls in a graph) 1,024 values on 4
    warps took 1.74 / 1.87 / 2.32 us at 1 / 17 / 64 tokens, where the former default (256 on 4
    warps past 16 tokens, 64 below) took 2.28 / 15.86 / 40.35 us. The sum over the streams then
    runs in another order than at 256: other last bits, the same fp32 bound.
    """
    _check_streams(X, "mhc_expand")
    T, hc, D = X.shape
    if block_d is None:
        block_d = min(1024, triton.next_power_of_2(D))
    _check_expand_args(X, f, post, C, "mhc_expand")
    check_device(X, f, post, C)
    out = torch.empty_like(X)
    if T:
        _expand_kernel[(T, triton.cdiv(D, block_d))](
            X, f.contiguous(), post.contiguous(), C.contiguous(), out, D,
            HC=hc, HCP=triton.next_power_of_2(hc), BLOCK_D=block_d,
            ROUND_BF16=X.dtype == torch.bfloat16 and not native(), NATIVE=native(), num_warps=num_warps or 4, **pdl.args(X.device))
    return out


@triton.jit
def _collapse_norm_kernel(x_ptr, pre_ptr, w_ptr, out_ptr, D, eps, HC: tl.constexpr, BLOCK_D: tl.constexpr,
                          ROUND_BF16: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)    # before any activation, table or cache access (pdl.py)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    y = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(HC):
        p = tl.load(pre_ptr + t * HC + j)
        y += p * tl.load(x_ptr + (t * HC + j) * D + d, mask=ok, other=0.0).to(tl.float32)
    y = y * tl.rsqrt(tl.sum(y * y, axis=0) / D + eps) * tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    if ROUND_BF16:  # the interpreter truncates on the store; round to nearest even first
        y = round_bf16(y, NATIVE)
    tl.store(out_ptr + t * D + d, y.to(out_ptr.dtype.element_ty), mask=ok)


def mhc_collapse_norm(X: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """A sub-layer's input in one launch: ``RMSNorm(sum_j pre[t, j] X[t, j, :]) * weight``, the
    collapse and the norm in fp32 registers (what ``mhc_collapse`` then an RMSNorm compute, without
    the fp32 [T, D] round trip). X: [T, hc, D]; pre: fp32 [T, hc]; weight: [D] -> [T, D] out_dtype."""
    _check_streams(X, "mhc_collapse_norm")
    T, hc, D = X.shape
    if pre.shape != (T, hc) or pre.dtype != torch.float32:
        raise ValueError(f"mhc_collapse_norm: pre must be fp32 [{T}, {hc}], got {pre.dtype} {tuple(pre.shape)}")
    if weight.shape != (D,):
        raise ValueError(f"mhc_collapse_norm: weight must be [{D}], got {tuple(weight.shape)}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"mhc_collapse_norm: out_dtype must be float32 or bfloat16, got {out_dtype}")
    check_device(X, pre, weight)
    out = torch.empty(T, D, dtype=out_dtype, device=X.device)
    if T:
        block = triton.next_power_of_2(D)
        _collapse_norm_kernel[(T,)](X, pre.contiguous(), weight, out, D, float(eps), HC=hc, BLOCK_D=block,
                                    ROUND_BF16=out_dtype == torch.bfloat16 and not native(), NATIVE=native(),
                                    num_warps=8 if block >= 2048 else 4, **pdl.args(X.device))
    return out

