"""mHC (manifold-constrained hyper-connection) kernels: the Sinkhorn mix, collapse and expand.

The torch code in ``dsv4_backend/model.py`` (``hc_sinkhorn``, ``hc_collapse``, ``hc_expand``)
is the reference; these kernels do the same arithmetic in fp32 registers so that one launch
replaces the ~90 small torch ops of a Sinkhorn mix (and the handful of a collapse / expand).

- ``mhc_mix``: mix logits ``m [T, hc * (2 + hc)]`` (after the ``fn`` matmul and the rsqrt
  scaling) plus ``scale [3]`` and ``base [hc * (2 + hc)]`` -> pre, post ``[T, hc]`` and the
  doubly-stochastic ``C [T, hc, hc]``; one program per block of tokens, hc padded to a power
  of two and masked.
- ``mhc_collapse``: ``y[t] = sum_j pre[t, j] X[t, j]`` (fp32 out).
- ``mhc_expand``: ``X'[t, k] = post[t, k] f[t] + sum_j C[t, j, k] X[t, j]`` (X's dtype out).
- ``mhc_collapse_norm``: ``RMSNorm(sum_j pre[t, j] X[t, j]) * weight``, a sub-layer's input
  (collapse and block norm in one launch).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4_backend.kernels._common import check_device, native, round_bf16


class MixWeights(NamedTuple):
    pre: torch.Tensor   # fp32 [T, hc]
    post: torch.Tensor  # fp32 [T, hc]
    C: torch.Tensor     # fp32 [T, hc, hc], C[t, j, k]: stream j -> stream k


@triton.jit
def _mix_kernel(m_ptr, m_stride, scale_ptr, base_ptr, pre_ptr, post_ptr, c_ptr, T, eps,
                HC: tl.constexpr, HCP: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    j = tl.arange(0, HCP)
    j_ok = j < HC
    row = m_ptr + t64[:, None] * m_stride                                   # [BT, 1]
    s_pre = tl.load(scale_ptr).to(tl.float32)
    s_post = tl.load(scale_ptr + 1).to(tl.float32)
    s_c = tl.load(scale_ptr + 2).to(tl.float32)

    # pre / post gates: [BT, HCP]
    ok2 = t_ok[:, None] & j_ok[None, :]
    out2 = t64[:, None] * HC + j[None, :]
    a = tl.load(row + j[None, :], mask=ok2, other=0.0).to(tl.float32)
    b = tl.load(base_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
    tl.store(pre_ptr + out2, tl.sigmoid(a * s_pre + b[None, :]) + eps, mask=ok2)
    a = tl.load(row + HC + j[None, :], mask=ok2, other=0.0).to(tl.float32)
    b = tl.load(base_ptr + HC + j, mask=j_ok, other=0.0).to(tl.float32)
    tl.store(post_ptr + out2, 2.0 * tl.sigmoid(a * s_post + b[None, :]), mask=ok2)

    # C: [BT, HCP (j), HCP (k)]; padded rows get finite logits, padded columns -inf, and both
    # are zeroed after the softmax so they never enter a row or column sum.
    col = 2 * HC + j[:, None] * HC + j[None, :]                            # [HCP, HCP]
    ok_jk = j_ok[:, None] & j_ok[None, :]
    ok3 = t_ok[:, None, None] & ok_jk[None, :, :]
    x = tl.load(row[:, :, None] + col[None, :, :], mask=ok3, other=0.0).to(tl.float32)
    bc = tl.load(base_ptr + col, mask=ok_jk, other=0.0).to(tl.float32)
    x = x * s_c + bc[None, :, :]
    x = tl.where(j_ok[None, None, :], x, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=2)[:, :, None])
    C = e / tl.sum(e, axis=2)[:, :, None] + eps
    C = tl.where(ok_jk[None, :, :], C, 0.0)
    C = C / (tl.sum(C, axis=1)[:, None, :] + eps)
    for _ in range(ITERS - 1):
        C = C / (tl.sum(C, axis=2)[:, :, None] + eps)
        C = C / (tl.sum(C, axis=1)[:, None, :] + eps)
    out3 = t64[:, None, None] * (HC * HC) + (j[:, None] * HC + j[None, :])[None, :, :]
    tl.store(c_ptr + out3, C, mask=ok3)


def mhc_mix(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
            sinkhorn_iters: int, eps: float, block_t: int = 16) -> MixWeights:
    """Sinkhorn mix weights from the scaled mix logits (fp32 arithmetic whatever m's dtype).

    m: [T, hc * (2 + hc)] (last dim contiguous); scale: [3]; base: [hc * (2 + hc)].
    """
    n_mix = hc * (2 + hc)
    if m.dim() != 2 or m.shape[1] != n_mix or m.stride(1) != 1:
        raise ValueError(f"mhc_mix: m must be [T, {n_mix}] with a contiguous last dim, "
                         f"got {tuple(m.shape)} strides {m.stride()}")
    if scale.numel() != 3 or base.numel() != n_mix:
        raise ValueError(f"mhc_mix: scale must have 3 and base {n_mix} elements, "
                         f"got {scale.numel()} and {base.numel()}")
    if sinkhorn_iters < 1:
        raise ValueError(f"mhc_mix: sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
    check_device(m, scale, base)
    T = m.shape[0]
    pre = torch.empty(T, hc, dtype=torch.float32, device=m.device)
    post = torch.empty(T, hc, dtype=torch.float32, device=m.device)
    C = torch.empty(T, hc, hc, dtype=torch.float32, device=m.device)
    if T:
        _mix_kernel[(triton.cdiv(T, block_t),)](
            m, m.stride(0), scale.contiguous(), base.contiguous(), pre, post, C, T, float(eps),
            HC=hc, HCP=triton.next_power_of_2(hc), ITERS=sinkhorn_iters, BLOCK_T=block_t)
    return MixWeights(pre, post, C)


# ---- collapse / expand ----------------------------------------------------------------------

def _check_streams(X: torch.Tensor, what: str) -> None:
    if X.dim() != 3 or not X.is_contiguous():
        raise ValueError(f"{what}: streams must be a contiguous [T, hc, D], got "
                         f"{tuple(X.shape)} strides {X.stride()}")


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
                   NATIVE: tl.constexpr):
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


def mhc_expand(X: torch.Tensor, f: torch.Tensor, post: torch.Tensor, C: torch.Tensor,
               block_d: int = 256) -> torch.Tensor:
    """New streams ``post[t, k] f[t] + sum_j C[t, j, k] X[t, j]`` in fp32, stored in X's dtype.

    X: [T, hc, D]; f: [T, D]; post: fp32 [T, hc]; C: fp32 [T, hc, hc] -> [T, hc, D].
    """
    _check_streams(X, "mhc_expand")
    T, hc, D = X.shape
    if f.shape != (T, D) or post.shape != (T, hc) or C.shape != (T, hc, hc):
        raise ValueError(f"mhc_expand: shapes X {tuple(X.shape)}, f {tuple(f.shape)}, "
                         f"post {tuple(post.shape)}, C {tuple(C.shape)} do not agree")
    if post.dtype != torch.float32 or C.dtype != torch.float32:
        raise ValueError(f"mhc_expand: post and C must be fp32, got {post.dtype}, {C.dtype}")
    check_device(X, f, post, C)
    out = torch.empty_like(X)
    if T:
        _expand_kernel[(T, triton.cdiv(D, block_d))](
            X, f.contiguous(), post.contiguous(), C.contiguous(), out, D,
            HC=hc, HCP=triton.next_power_of_2(hc), BLOCK_D=block_d,
            ROUND_BF16=X.dtype == torch.bfloat16 and not native(), NATIVE=native())
    return out


@triton.jit
def _collapse_norm_kernel(x_ptr, pre_ptr, w_ptr, out_ptr, D, eps, HC: tl.constexpr, BLOCK_D: tl.constexpr,
                          ROUND_BF16: tl.constexpr, NATIVE: tl.constexpr):
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
                                    num_warps=8 if block >= 2048 else 4)
    return out
