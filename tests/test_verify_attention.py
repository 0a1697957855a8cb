"""The s_q-row sparse decode kernel (``kernels/verify_attention.py``) under the interpreter.

Each case builds requests with their own context lengths (short ones, shorter than the window,
among them) whose s_q consecutive query rows have the windows the metadata builds (slots from a
per-request page table of 128-row SWA pages, so windows cross pages), and extra rows as a verify
has them: own top-k lists per row with -1 holes (C4), or one visible-row list per request with
rows past each row's visible count at -1 (C128). The kernel is checked against the float64
reference row by row (attention_bound) and against the one-row kernel (within the sum of the two
bounds: each is a float32 result in its own order).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from bounds import assert_within, attention_bound  # noqa: E402
from dsv4_backend.kernels import reference as R  # noqa: E402
from dsv4_backend.kernels.sparse_attention import sparse_decode  # noqa: E402
from dsv4_backend.kernels.verify_attention import VerifyAttentionConfig, sparse_verify, verify_tiling  # noqa: E402
from memory.layout import read_kv_rows  # noqa: E402
from test_kernels import DEV, _kv_pool  # noqa: E402

W = 128


def _verify_inputs(g, s_q, ctx, h, mode, k=40, c4_rows=256, page_rows=128):
    """q [T, h, 512], window_slots [T, W], extra pool and rows [T, k] of requests whose rows sit
    at positions ctx[b] .. ctx[b] + s_q - 1."""
    B = len(ctx)
    pages_per_req = max(ctx) // page_rows + 2
    swa = _kv_pool(B * pages_per_req, page_rows, g)
    perm = torch.randperm(B * pages_per_req, generator=g).view(B, pages_per_req)
    win = []
    for b, n in enumerate(ctx):
        for i in range(s_q):
            p = n + i - W + 1 + torch.arange(W)
            slot = perm[b, p.clamp_min(0) // page_rows] * page_rows + p.clamp_min(0) % page_rows
            win.append(torch.where(p >= 0, slot, -1))
    win = torch.stack(win)
    extra, ext = None, None
    if mode == "c4":
        extra = _kv_pool(c4_rows // 64, 64, g)
        ext = torch.randint(0, c4_rows, (B * s_q, k), generator=g)
        ext[1::2, : k // 3] = ext[0::2, : k // 3]          # neighbours share part of their lists
        ext[:, ::5] = -1                                    # -1 holes
        ext[-1, k // 2:] = -1                               # a short list
    elif mode == "c128":
        extra = _kv_pool(4, 64, g)
        ext = []
        for b, n in enumerate(ctx):
            rows = torch.randperm(256, generator=g)[:k]
            for i in range(s_q):
                visible = min(k, (n + i + 1) // 128)          # blocks completed up to the row's position
                ext.append(torch.where(torch.arange(k) < visible, rows, -1))
        ext = torch.stack(ext)
    q = torch.randn(B * s_q, h, 512, generator=g) * 0.3   # flat softmax: every key weighs
    sink = torch.randn(h, generator=g)
    return q, swa, win, extra, ext


def _bounds(q, swa, win, extra, ext, sink, scale):
    keys, valid = read_kv_rows(swa.cpu(), win.clamp_min(0).long().cpu()), (win >= 0).cpu()
    if extra is not None:
        keys = torch.cat([keys, read_kv_rows(extra.cpu(), ext.clamp_min(0).long().cpu())], 1)
        valid = torch.cat([valid, (ext >= 0).cpu()], 1)
    gpu = q.is_cuda
    return attention_bound(q.float().cpu(), keys, valid, sink.cpu(), scale, bf16_p=gpu, bf16_out=gpu)


@pytest.mark.parametrize("s_q,h,mode,ctx,num_splits,cfg", [
    (1, 8, "c4", (300, 40), None, {}),
    (2, 8, "c4", (127, 250, 5), 3, {}),                 # h = 8: two rows share a program
    (3, 8, "c128", (380, 126, 60), None, {}),           # a block completes inside a verify (126 + 1 = 127)
    (3, 16, "c4", (200, 2), 2, {}),                     # 16 heads: four rows per program (3 real)
    (3, 16, "window", (129, 70), None, dict(halves=False, scales="element")),
    (3, 16, "c128", (255, 10), 1, dict(rows=1)),        # forced one row per program
    (2, 20, "c4", (140,), 4, dict(rows=2, halves=False))])   # heads padded to 32, two head blocks
def test_sparse_verify_matches_reference_and_row_kernel(s_q, h, mode, ctx, num_splits, cfg):
    g = torch.Generator().manual_seed(7 * s_q + h + len(ctx))
    q, swa, win, extra, ext = _verify_inputs(g, s_q, ctx, h, mode)
    sink = torch.randn(h, generator=g)
    scale = 512 ** -0.5
    qd = q.to(DEV).to(torch.bfloat16 if DEV == "cuda" else torch.float32)
    d = lambda x: None if x is None else x.to(DEV)  # noqa: E731
    out = torch.full((q.shape[0], h, 512), float("nan"), device=DEV, dtype=qd.dtype)
    cfg = VerifyAttentionConfig(block_n=32, **cfg)
    got = sparse_verify(qd, swa, d(win), extra, d(ext), d(sink), scale, s_q, shared_extra=mode == "c128",
                        num_splits=num_splits, config=cfg, out=out)
    ref = R.sparse_decode_ref(qd.double(), swa, d(win), extra, d(ext), d(sink), scale)
    out_b, lse_b = _bounds(qd, swa, win, extra, ext, sink, scale)
    assert_within(got.out, ref.out, out_b, "out vs float64")
    assert_within(got.lse, ref.lse, lse_b, "lse vs float64")
    row = sparse_decode(qd, swa, d(win), extra, d(ext), d(sink), scale)
    assert_within(got.out, row.out, 2 * out_b, "out vs the one-row kernel")
    assert_within(got.lse, row.lse, 2 * lse_b, "lse vs the one-row kernel")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under the interpreter")
def test_the_shared_list_is_what_each_row_sees():
    """C128 with ``shared_extra``: a row whose list has -1 where the last row has a block must
    not see that block (a block completed by a later row of the verify); the kernel's output
    differs from one where every row saw the last row's list."""
    g = torch.Generator().manual_seed(3)
    h, s_q = 16, 3
    q, swa, win, extra, ext = _verify_inputs(g, s_q, (126,), h, "c128")
    assert (ext[0] < 0).all() and (ext[2] >= 0).sum() == 1   # row 2 (position 128) sees block 0
    sink = torch.zeros(h)
    got = sparse_verify(q, swa, win, extra, ext, sink, 0.05, s_q, shared_extra=True)
    ref = R.sparse_decode_ref(q.double(), swa, win, extra, ext, sink, 0.05)
    everyone = R.sparse_decode_ref(q.double(), swa, win, extra, ext[2:].expand_as(ext), sink, 0.05)
    out_b, _ = _bounds(q, swa, win, extra, ext, sink, 0.05)
    assert_within(got.out, ref.out, out_b, "out")
    assert ((got.out[0] - everyone.out[0]).abs() > out_b[0]).any(), "row 0 saw block 0"


def test_tiling():
    assert verify_tiling(64, 4) == (1, 64)     # Flash on one GPU: the one-row tiling
    assert verify_tiling(8, 4) == (4, 8)       # TP 8: four rows share every key tile
    assert verify_tiling(16, 3) == (4, 16)
    assert verify_tiling(2, 2) == (2, 8)       # heads padded to M = 16
    assert verify_tiling(64, 4, VerifyAttentionConfig(rows=4)) == (4, 16)
    assert verify_tiling(64, 1, VerifyAttentionConfig(rows=4)) == (1, 64)
    with pytest.raises(ValueError):
        verify_tiling(64, 4, VerifyAttentionConfig(rows=3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under the interpreter")
def test_bench_verify_inputs_keep_the_kernel_contract():
    """bench_kernels' verify tables (what the integrator times on the H200) have the shifted
    windows and the shared C128 list the kernel assumes; on them the s_q-row kernel, four rows
    per program at Flash's 64 heads, gives the one-row kernel's results."""
    from bench import bench_kernels as BK
    x = BK.verify_inputs("flash_hca", 1, 512, 4, device="cpu")
    win, ext = x["sets"][0]
    assert torch.equal(win[1:, :-1], win[:-1, 1:]) and (win[:, -1] >= 0).all()
    assert torch.equal(ext, ext[:1].expand_as(ext)) and ext.shape == (4, 4)
    q = x["q"].float()
    cfg = VerifyAttentionConfig(rows=4)
    got = sparse_verify(q, x["swa"], win, x["extra"], ext, x["sink"], 512 ** -0.5, 4, shared_extra=True, config=cfg)
    row = sparse_decode(q, x["swa"], win, x["extra"], ext, x["sink"], 512 ** -0.5)
    out_b, lse_b = _bounds(q, x["swa"], win, x["extra"], ext, x["sink"], 512 ** -0.5)
    assert_within(got.out, row.out, 2 * out_b, "out")
    assert_within(got.lse, row.lse, 2 * lse_b, "lse")


def test_the_package_name_is_the_function():
    """The backend looks the kernel up on the package: a submodule of the same name, once
    imported, would shadow it there."""
    from dsv4_backend import kernels
    assert kernels.sparse_verify is sparse_verify and kernels.VerifyAttentionConfig is VerifyAttentionConfig


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under the interpreter")
def test_bench_time_verify_runs_on_the_cpu(monkeypatch):
    """bench_kernels.time_verify's code path (the timers stood in: they need CUDA): both kernels
    run on its tables and the rows it counts are the kernels' (the one-row kernel's 128 per row,
    the s_q kernel's union window per program)."""
    from bench import bench_kernels as BK
    monkeypatch.setattr(BK, "bench", lambda fn: (fn(), (1.0, 1.0))[1])
    monkeypatch.setattr(BK, "cold_replay_us", lambda fn: (fn(), 1.0)[1])
    ceil = BK.Ceilings(copy_gbps=1000.0, bf16_tflops=100.0)
    x = BK.verify_inputs("flash_swa", 1, 256, 4, device="cpu")
    x["q"] = x["q"].float()
    rows = BK.time_verify("flash_swa", 1, 256, 4, ceil, "row", inputs=x)
    shared = BK.time_verify("flash_swa", 1, 256, 4, ceil, "verify", VerifyAttentionConfig(rows=4), inputs=x)
    assert rows.extra["gathered_bytes"] == 4 * 128 * 584
    assert shared.extra["gathered_bytes"] == 4 * 131 * 584      # 4 head blocks of 16, each the 131-row union
    assert rows.bytes == shared.bytes and "gathered" in BK.row(shared)
