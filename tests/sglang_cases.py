"""Cases for TritonDSV4AttnBackend's methods on SGLang's own pool and metadata classes.

Shared by tests/test_sglang_adapter.py (CPU, Triton interpreter, tiny shapes) and
bench/gpu_sglang_check.py (one H200, Flash / Pro shapes). Needs SGLang 0.5.23 importable.
Each case fills SGLang's ``DeepSeekV4TokenToKVPool`` with known rows (our documented layout),
builds SGLang's ``DSV4AttnMetadata`` with per-query lists, runs our backend's method and returns
what it wrote beside a float64 reference computed from the same rows and the bound of
tests/bounds.py; the caller asserts or prints.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch

import dsv4_backend.sglang_adapter as A
from bounds import attention_bound, indexer_score_bound
from memory.layout import read_indexer_rows, read_kv_rows, write_indexer_rows, write_kv_rows

SCALE = 512 ** -0.5
LAYER_OF_RATIO = {0: 0, 4: 1, 128: 2}


def dsv4_pool(device: str = "cpu", swa_tokens: int = 512, full_tokens: int = 1024, c128_pages: int = 8,
              state_slots: int = 64, online: bool = False):
    """SGLang's DeepSeekV4TokenToKVPool: layer 0 SWA only, layer 1 C4 (+ indexer), layer 2 C128.
    ``online``: the C128 state as SGLang builds it under ``SGLANG_OPT_USE_ONLINE_COMPRESS``
    (its module constant ``ONLINE_C128``, read at import, set while the pool is built)."""
    import sglang.srt.mem_cache.deepseek_v4_memory_pool as M
    was, M.ONLINE_C128 = M.ONLINE_C128, online
    try:
        return _dsv4_pool(device, swa_tokens, full_tokens, c128_pages, state_slots)
    finally:
        M.ONLINE_C128 = was


def _dsv4_pool(device, swa_tokens, full_tokens, c128_pages, state_slots):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.runtime_context import get_context
    with get_context().override_server_args(page_size=256):
        return DeepSeekV4TokenToKVPool(
            max_num_reqs=2, swa_size=swa_tokens, c4_size=full_tokens // 4, c128_size=c128_pages,
            c4_state_pool_size=state_slots, c128_state_pool_size=16, page_size=256, swa_page_size=256,
            dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32, c128_state_dtype=torch.float32,
            qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128, layer_num=3,
            device=device, enable_memory_saver=False, compression_ratios=[0, 4, 128],
            full_size=full_tokens)


def make_backend(pool, **fields) -> A.TritonDSV4AttnBackend:
    """Our backend without a model runner: SGLang's pool plus the fields its methods read."""
    backend = object.__new__(A.TritonDSV4AttnBackend)
    backend.__dict__.update(token_to_kv_pool=pool, pre_kv_store_hook=None, trtllm_attn=False,
                            is_dsv41=False, mtp_enabled=False, hisparse_coordinator=None,
                            debug_use_external_c4_sparse_indices=False, softmax_scale=SCALE, **fields)
    return backend


def core_metadata(swa_idx, swa_len, c4=None, c128=None, index_topk=512):
    """SGLang's DSV4AttnMetadata holding the per-query lists the attention reads."""
    from sglang.srt.layers.attention.deepseek_v4_backend import DSV4AttnMetadata
    T, dev = swa_idx.shape[0], swa_idx.device
    core = DSV4AttnMetadata(
        page_size=256, page_table=torch.zeros(T, 1, dtype=torch.int32, device=dev),
        raw_out_loc=torch.zeros(T, dtype=torch.int64, device=dev), cuda_int32_kwargs={},
        seq_lens_casual=torch.ones(T, dtype=torch.int32, device=dev),
        positions_casual=torch.zeros(T, dtype=torch.int64, device=dev),
        swa_page_indices=swa_idx, swa_topk_lengths=swa_len, index_topk=index_topk,
        present_ratios=(4, 128))
    for ratio, lists in ((4, c4), (128, c128)):
        if lists is not None:
            core.set_sparse_topk(ratio, page_indices=lists[0], topk_lengths=lists[1])
    return core


def as_bytes(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(torch.uint8)


def fill_kv(buf: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Every row of an SGLang attention buffer set to known rows; returns the host bytes."""
    host = torch.zeros(buf.shape, dtype=torch.uint8)
    n = host.shape[0] * (host.shape[1] // 584)
    write_kv_rows(host, torch.arange(n), torch.randn(n, 512, generator=g, dtype=torch.float64) * 2)
    as_bytes(buf).copy_(host)
    return host


def slot_lists(g, rows: int, width: int, slots: int, lengths: list[int]):
    """Per-query slot lists int32 [rows, width] (-1 at random places) and their lengths [rows]."""
    idx = torch.randint(0, slots, (rows, width), generator=g, dtype=torch.int32)
    idx[torch.rand(rows, width, generator=g) < 0.15] = -1
    return idx, torch.tensor(lengths, dtype=torch.int32)


def cut(idx, lengths, rows: int) -> torch.Tensor:
    """FlashMLA's reading of (indices, topk_lengths): entries past the length are not read."""
    j = torch.arange(idx.shape[1])
    return torch.where(j[None] < lengths[:rows, None], idx[:rows], -1).long()


def attention_fp64(q, keys, valid, sink, scale=SCALE):
    """One softmax over the valid keys plus the sink, float64: (out [T, h, 512], lse [T, h])."""
    q, keys = q.double(), keys.double()
    s = (torch.einsum("thd,tnd->thn", q, keys) * scale).masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    z = torch.logaddexp(lse, sink.double()[None, :])
    out = torch.einsum("thn,tnd->thd", torch.exp(s - z[..., None]).nan_to_num(0.0), keys)
    return out, lse


def attention_case(pool, ratio: int, g, T: int, H: int, heads: int, swa_lengths, extra_width: int,
                   extra_lengths, device: str = "cpu", gpu_arithmetic: bool = False) -> dict:
    """``backend.forward`` for one layer of ``ratio`` over SGLang's pool and metadata.

    The metadata has one row more than the queries (CUDA-graph padding); q has H heads and the
    sink ``heads`` (FlashMLA's head padding). Returns got [T, H, 512] (host), want / bound
    [T, heads, 512] and the SGLang-form inputs (``sglang_inputs``) for comparisons with
    SGLang's own kernels."""
    layer_id = LAYER_OF_RATIO[ratio]
    swa = pool.get_swa_key_buffer_radix(layer_id)
    swa_host = fill_kv(swa, g)
    swa_idx, swa_len = slot_lists(g, T + 1, 128 if max(swa_lengths) > 64 else 64, swa.shape[0] * 256, swa_lengths)
    lists, extra_host, ext = {}, None, None
    if ratio:
        extra = pool.get_extra_key_buffer(layer_id)
        extra_host = fill_kv(extra, g)
        P = pool.get_extra_key_page_size(layer_id)
        ext_idx, ext_len = slot_lists(g, T + 1, extra_width, extra.shape[0] * P, extra_lengths)
        ext_idx[1, 0] = -1  # SGLang's *_clamp1 lengths: length 1 over an empty list
        ext = (ext_idx, ext_len)
        lists[ratio] = (ext_idx.to(device), ext_len.to(device))
    core = core_metadata(swa_idx.to(device), swa_len.to(device), c4=lists.get(4), c128=lists.get(128))
    backend = make_backend(pool, forward_metadata=NS(core_attn_metadata=core, late_layer_tail=None))
    q = torch.randn(T, H, 512, generator=g) * 2
    if gpu_arithmetic:
        q = q.bfloat16()
    sink = torch.randn(heads, generator=g)
    layer = NS(layer_id=layer_id, v_head_dim=512)
    batch = NS(forward_mode=NS(is_idle=lambda: False))
    qd = q.to(device)
    got = backend.forward(qd, qd, qd, layer, batch, compress_ratio=ratio, save_kv_cache=False,
                          attn_sink=sink.to(device))

    window = cut(swa_idx, swa_len, T)
    keys, valid = read_kv_rows(swa_host, window.clamp_min(0)), window >= 0
    if ratio:
        e = cut(*ext, T)
        keys = torch.cat([keys, read_kv_rows(extra_host, e.clamp_min(0))], 1)
        valid = torch.cat([valid, e >= 0], 1)
    qh = q[:, :heads].float()
    want, _ = attention_fp64(qh, keys, valid, sink)
    bound, _ = attention_bound(qh, keys, valid, sink, SCALE, bf16_p=gpu_arithmetic,
                               bf16_out=got.dtype == torch.bfloat16)
    return dict(got=got.cpu(), want=want, bound=bound, heads=heads,
                sglang_inputs=dict(q=qd[:, :heads], swa=swa, swa_idx=swa_idx[:T].to(device),
                                   swa_len=swa_len[:T].to(device), sink=sink.to(device),
                                   extra=pool.get_extra_key_buffer(layer_id) if ratio else None,
                                   ext_idx=None if ext is None else ext[0][:T].to(device),
                                   ext_len=None if ext is None else ext[1][:T].to(device)))


def topk_is_best(chosen, scores, bound, k: int) -> bool:
    """``chosen`` (list positions) is a best-``k`` set of float64 ``scores`` when each score may
    be off by ``bound``: no unchosen position beats a chosen one by more than both bounds."""
    vis = scores.shape[0]
    if chosen.numel() != min(k, vis) or chosen.unique().numel() != chosen.numel():
        return False
    picked = torch.zeros(vis, dtype=torch.bool)
    picked[chosen] = True
    return bool(((scores + bound)[picked][:, None] >= (scores - bound)[~picked][None]).all())


def indexer_case(pool, g, T: int, H: int, k: int, visible: list[int], pages: int,
                 device: str = "cpu") -> dict:
    """``backend.forward_c4_indexer`` (the model's query projections given: FP8 q, folded
    weights) over SGLang's indexer pool and page table, beside SGLang's own torch indexer
    (``fp8_paged_mqa_logits_torch`` + ``topk_transform_pytorch_vectorized``) on the same input.

    Returns ours / theirs int32 [T, k] rows, the padded metadata row (must stay 7), the
    visible slots per query, float64 scores and both bounds (SGLang's torch path rounds each
    head's dot product to bf16: 2^-8 of its magnitude more)."""
    from sglang.srt.layers.attention.dsv4.indexer import (
        fp8_paged_mqa_logits_torch, topk_transform_pytorch_vectorized,
    )
    buf = pool.get_index_k_with_scale_buffer(1)
    host = torch.zeros(buf.shape, dtype=torch.uint8)
    n = host.shape[0] * 64
    write_indexer_rows(host, torch.arange(n), torch.randn(n, 128, generator=g, dtype=torch.float64))
    as_bytes(buf).copy_(host)
    table = torch.stack([torch.randperm(host.shape[0], generator=g)[:pages] for _ in range(T)]).to(torch.int32)
    vis = torch.tensor(visible, dtype=torch.int32)
    q = (torch.randn(T, H, 128, generator=g) * 4).to(torch.float8_e4m3fn)
    w = torch.randn(T, H, generator=g)
    qd, wd, td, vd = q.to(device), w.to(device), table.to(device), vis.to(device)
    one = torch.ones(T + 1, dtype=torch.int32, device=device)
    core = core_metadata(torch.zeros(T + 1, 64, dtype=torch.int32, device=device), one,
                         c4=(torch.full((T + 1, k), 7, dtype=torch.int32, device=device), one),
                         index_topk=k)
    im = NS(page_table=td, compressed_seq_lens=vd, compressed_page_size=64)
    backend = make_backend(pool, index_topk=k, forward_metadata=NS(core_metadata=core, indexer_metadata=im))
    c4_indexer = NS(layer_id=1, use_fp4_indexer=False, compressor=None,
                    compute_weights=lambda x, skip_scale: wd,
                    compute_q=lambda q_lora, positions, weights, quant: (qd[:q_lora.shape[0]], weights[:, :, None]))
    x = torch.zeros(T, 8, device=device)
    backend.forward_c4_indexer(x, x, c4_indexer, NS(forward_mode=NS(is_idle=lambda: False)),
                               skip_compressor=True)
    ours = core.c4_sparse_page_indices.cpu()

    logits = fp8_paged_mqa_logits_torch(qd.unsqueeze(1), as_bytes(buf).view(-1, 64, 1, 132), wd, vd,
                                        td, None, pages * 64, False)
    theirs = torch.empty(T, k, dtype=torch.int32, device=device)
    topk_transform_pytorch_vectorized(logits, vd, td, theirs, 64)

    j = torch.arange(pages * 64)
    slots = (table.long()[:, j // 64] * 64 + j % 64).masked_fill(j[None] >= vis[:, None].long(), -1)
    keys = read_indexer_rows(host, slots.clamp_min(0)).double()
    qf = q.double()
    score = (w.double()[:, :, None] * torch.einsum("thd,tld->thl", qf, keys).clamp_min(0)).sum(1)
    ours_b = indexer_score_bound(qf, w, keys)
    theirs_b = ours_b + 2.0 ** -8 * (w.double().abs()[:, :, None]
                                     * torch.einsum("thd,tld->thl", qf.abs(), keys.abs())).sum(1)
    return dict(ours=ours[:T], padded_row=ours[T], theirs=theirs.cpu(), slots=slots, visible=visible,
                score=score, ours_bound=ours_b, theirs_bound=theirs_b, k=k)


def indexer_findings(case: dict) -> list[str]:
    """What is wrong with an ``indexer_case`` (empty when nothing): each selection is -1 padded,
    visible and a best-k set within its bound; ours and SGLang's differ only by near-ties."""
    bad, k = [], case["k"]
    if not torch.equal(case["padded_row"], torch.full((k,), 7, dtype=torch.int32)):
        bad.append("a padded metadata row was written")
    for t, vis in enumerate(case["visible"]):
        position = {s: p for p, s in enumerate(case["slots"][t, :vis].tolist())}
        score, sel = case["score"][t, :vis], {}
        for name, rows, b in (("ours", case["ours"][t], case["ours_bound"]),
                              ("SGLang's", case["theirs"][t], case["theirs_bound"])):
            live = rows[rows >= 0].tolist()
            if not torch.equal(rows[len(live):], torch.full((k - len(live),), -1, dtype=torch.int32)):
                bad.append(f"{name} row {t}: -1 before a chosen row")
            if not all(s in position for s in live):
                bad.append(f"{name} row {t}: a chosen row is not visible")
                continue
            chosen = torch.tensor([position[s] for s in live], dtype=torch.long)
            if not topk_is_best(chosen, score, b[t, :vis], k):
                bad.append(f"{name} row {t}: not a best-{k} set within its bound")
            sel[name] = set(live)
        if len(sel) < 2:
            continue
        ob, tb = case["ours_bound"][t], case["theirs_bound"][t]
        for a in sel["ours"] - sel["SGLang's"]:
            for c in sel["SGLang's"] - sel["ours"]:
                pa, pc = position[a], position[c]
                if abs(score[pa] - score[pc]) > ob[pa] + ob[pc] + tb[pa] + tb[pc]:
                    bad.append(f"row {t}: ours picks {a}, SGLang's {c}, not a near-tie")
    return bad


def _ring_plan(seq_lens: list[int], base_page: int, device: str):
    """SGLang's C4 DecodePlan rows for requests with 2-page (8-slot) rings, request r on pages
    base_page + 2r and + 2r + 1: block b of a request lives on page b % 2 of its ring. Returns
    the plan (uint8 [bs, 16]) and, per request, the previous / current block's page."""
    rows, pages = [], []
    for r, s in enumerate(seq_lens):
        block = (s - 1) // 4
        cur, prev = base_page + 2 * r + block % 2, base_page + 2 * r + (block + 1) % 2
        rows.append([s, cur * 4 + (s - 1) % 4, prev, cur])
        pages.append((prev, cur))
    plan = torch.tensor(rows, dtype=torch.int32).view(torch.uint8).to(device)
    return plan, pages


def _c128_plan(seq_lens: list[int], base_page: int, device: str):
    """SGLang's C128 DecodePlan rows, request r's block on state page base_page + r (128 slots):
    write_loc the new token's slot, read_page_1 the page pooled when the block closes (SGLang's
    C128 kernel reads no read_page_0; set to the same page). Returns the plan and the pages."""
    rows, pages = [], []
    for r, s in enumerate(seq_lens):
        page = base_page + r
        rows.append([s, page * 128 + (s - 1) % 128, page, page])
        pages.append((page, page))
    plan = torch.tensor(rows, dtype=torch.int32).view(torch.uint8).to(device)
    return plan, pages


def compressor_case(pool, g, indexer: bool, seq_lens: list[int], device: str = "cpu",
                    sglang_kernels: bool = False, ratio: int = 4) -> dict:
    """``backend.forward_core_compressor`` / ``forward_indexer_compressor`` for one decode step
    of a C4 (layer 1: attention or indexer rows) or C128 (layer 2, attention rows) compressor on
    SGLang's state ring (``get_*_compress_states``) and C4 / C128 / indexer pool, with a
    DecodePlan built as SGLang's planner lays it out (``_ring_plan`` / ``_c128_plan``) and
    ``ape`` as SGLang's loader stores it (C4: permuted; C128: as in the checkpoint).

    Returns our pool and the reference pool (``reference.compress_ref`` on the same state, with
    the candidates listed from the ring pages, not from the plan), the destination rows, the
    bound on each row before storage, and the state row our method wrote for each request.
    ``sglang_kernels``: run SGLang's own ``forward_unified`` (its JIT compress + store) instead
    of ours on the same inputs (GPU only)."""
    from sglang.kernels.ops.attention.dsv4 import CompressorDecodePlan
    assert ratio == 4 or not indexer, "the indexer compresses C4 rows only"
    layer = LAYER_OF_RATIO[ratio]
    d = 128 if indexer else 512
    coff = 2 if ratio == 4 else 1
    states = pool.get_indexer_compress_states(layer) if indexer else pool.get_attention_compress_states(layer)
    state = states.kv_score_buffer.kv_score
    bs = len(seq_lens)
    state.copy_((torch.randn(state.shape, generator=g) * 2).to(state.dtype))
    plan, pages = (_ring_plan if ratio == 4 else _c128_plan)(seq_lens, base_page=1, device=device)
    target = pool.get_index_k_with_scale_buffer(layer) if indexer else pool.get_extra_key_buffer(layer)
    rows_total = target.shape[0] * (64 if indexer else pool.get_extra_key_page_size(layer))
    dest = torch.full((bs,), -1, dtype=torch.int64)
    closing = [r for r, s in enumerate(seq_lens) if s % ratio == 0]
    dest[closing] = torch.randperm(rows_total, generator=g)[:len(closing)]
    out_loc = dest  # SGLang's c{ratio}_out_loc: the row of a token that closes a block, else -1
    ape = torch.randn(ratio, coff * d, generator=g)
    # SGLang's _apply_ape_hotfix permutes an overlapping (C4) ape: [ape[:, :d]; ape[:, d:]]
    stored_ape = torch.cat([ape[:, :d], ape[:, d:]], 0).reshape(4, 2 * d) if ratio == 4 else ape
    w = torch.rand(d, generator=g) + 0.5
    angles = torch.randn(4096, 32, generator=g, dtype=torch.float64)
    freqs = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    kv_score = torch.randn(bs, 2 * coff * d, generator=g) * 2
    as_bytes(target).zero_()
    compressor = NS(ratio=ratio, head_dim=d, is_in_indexer=indexer, rotate=indexer, ape=stored_ape.to(device),
                    ape_converted=True, norm=NS(weight=w.to(device), variance_epsilon=1e-6),
                    freqs_cis=freqs.to(device), compute_kv_score=lambda x, fb: kv_score.to(device),
                    get_state_pool=lambda backend: states)
    metadata = NS(**{f"c{ratio}_compress_metadata": CompressorDecodePlan(ratio, plan),
                     "core_metadata": NS(**{f"c{ratio}_out_loc": out_loc.to(device)})})
    backend = make_backend(pool, enable_deepseek_v4_fp4_indexer=False, forward_metadata=metadata)
    before = state.cpu().clone()
    method = super(A.TritonDSV4AttnBackend, backend).forward_unified if sglang_kernels else backend.forward_unified
    method(torch.zeros(bs, 8, device=device), NS(forward_mode=NS(is_idle=lambda: False), batch_size=bs),
           layer, compressor)

    ring = before.clone()
    for r, s in enumerate(seq_lens):
        ring[pages[r][1] * ratio + (s - 1) % ratio] = kv_score[r].to(state.dtype)
    if ratio == 4:
        j = torch.arange(4)
        sources = torch.stack([torch.cat([torch.full((4,), -1) if s <= 4 else pages[r][0] * 4 + j,
                                          pages[r][1] * 4 + j]) for r, s in enumerate(seq_lens)])
    else:
        sources = torch.stack([pages[r][1] * 128 + torch.arange(128) for r in range(bs)])
    keep = dest >= 0
    pos = torch.tensor(seq_lens) - ratio
    rot = freqs[pos.clamp_min(0)][keep]
    ref_pool = torch.zeros(target.shape, dtype=torch.uint8)
    from dsv4_backend.kernels import reference as R
    from bounds import compress_bounds
    R.compress_ref(ref_pool, dest[keep], ring, sources[keep], ape, w, rot.real.float(), rot.imag.float(), ratio,
                   indexer=indexer)
    return dict(pool=as_bytes(target).cpu(), ref_pool=ref_pool, dest=dest[keep], state=state.cpu(),
                want_state=ring, bound=compress_bounds(ring, sources[keep], ape, w, ratio, d, indexer),
                indexer=indexer)


def ring_slot(ratio: int, r: int, pos: int, base_page: int = 1) -> int:
    """Request r's state slot of position ``pos`` in the rings of these cases (SGLang's request
    ring, ``compute_req_ring_loc``: C4 2 pages of 4 slots, C128 one page of 128, request r's
    first page base_page + 2r / + r): the layout ``_ring_plan`` / ``_c128_plan`` use."""
    ring = 8 if ratio == 4 else 128
    return base_page * ratio + r * ring + pos % ring


def prefill_plan(ratio: int, rids: list[int], seq_lens: list[int], extend_lens: list[int],
                 padding: int, device: str):
    """SGLang's CompressorPrefillPlan (plan_c uint8 [n, 16], plan_w uint8 [n, 8]) for one extend
    step, laid out as SGLang's planner (``c_plan.cuh``, host path, request rings, no MTP pad)
    lays it: a compress row for each q token closing a block (seq_len, ragged_id, buffer_len =
    the window's positions before the extend, read pages), a write row for each q token from
    the last closed block's start (C4: one block earlier) on; ``padding`` invalid rows after
    each (the CUDA-graph padding)."""
    window = 8 if ratio == 4 else 128
    rows_c, rows_w, ragged = [], [], 0
    for r, s, e in zip(rids, seq_lens, extend_lens):
        first_w = s // ratio * ratio - (ratio if ratio == 4 else 0)
        for j in range(e):
            p = s - e + j
            if (p + 1) % ratio == 0:
                buffer_len = window - min(j + 1, window)
                rows_c.append([p + 1, (ragged + j) | buffer_len << 16,
                               ring_slot(ratio, r, max(p - ratio, 0)) // ratio, ring_slot(ratio, r, p) // ratio])
            if p >= first_w:
                rows_w.append([ragged + j, ring_slot(ratio, r, p)])
        ragged += e
    rows_c += [[-1, 0, -1, -1]] * padding
    rows_w += [[-1, -1]] * padding
    as_plan = lambda rows, width: torch.tensor(rows, dtype=torch.int32).reshape(-1, width // 4).view(torch.uint8).to(device)
    return as_plan(rows_c, 16), as_plan(rows_w, 8)


def online_prefill_plan(rids: list[int], seq_lens: list[int], extend_lens: list[int], padding: int,
                        device: str, base_slot: int = 1):
    """SGLang's online C128 CompressorPrefillPlan (plan_c, plan_w: uint8 [n, 16] CompressPlan
    rows) for one extend step, laid out as its planner (``c128_online_v2.cuh``, no MTP) lays it:
    each request's extend cut at 128-block boundaries into segments {seq_len of the last token,
    its ragged_id, buffer_len = segment length, read_page_0 = read_page_1 = the request's state
    row}; segments that close a block in plan_c, the trailing partial one in plan_w."""
    rows_c, rows_w, ragged = [], [], 0
    for r, s, e in zip(rids, seq_lens, extend_lens):
        pos = s - e
        while pos < s:
            end = min(s, pos // 128 * 128 + 128)
            row = [end, (ragged + end - 1 - (s - e)) | (end - pos) << 16, base_slot + r, base_slot + r]
            (rows_c if end % 128 == 0 else rows_w).append(row)
            pos = end
        ragged += e
    pad = [[-1, 0, -1, -1]] * padding
    as_plan = lambda rows: torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).view(torch.uint8).to(device)
    return as_plan(rows_c + pad), as_plan(rows_w + pad)


def prefill_decode_case(pool, g, indexer: bool, ratio: int, steps: list[tuple[str, list[int]]],
                        device: str = "cpu", sglang_kernels: bool = False, online: bool = False) -> dict:
    """``forward_unified`` over several steps of a few requests: extend steps (SGLang's
    CompressorPrefillPlan, ``prefill_plan``, q-token ``c{ratio}_out_loc``) and decode steps
    (its DecodePlan, ``_ring_plan`` / ``_c128_plan``), on SGLang's state ring (random bytes
    at the start) and pool. ``steps``: ("extend", new tokens per request, 0 = not in the step)
    or ("decode", 1 / 0 per request). Every block closed by any step is checked against
    ``reference.compress_ref`` on candidates listed from each request's whole [C | Z]
    sequence (not from any ring or plan), so a block closed by a decode step right after a
    prompt whose length is not a multiple of the ratio passes only if the extend step left the
    unfinished block (and C4's overlap block) in the ring where the decode plan reads it.

    Returns our pool and the reference pool, the destination rows, the bound on each row
    before storage, the state after the steps and before them, and the ring slots of the
    requests (everything else in the state must be untouched). ``sglang_kernels``: SGLang's
    own ``forward_unified`` (its JIT planner-format compress + store) instead of ours (GPU).
    ``online``: C128 on SGLang's online state (a pool built with ``SGLANG_OPT_USE_ONLINE_COMPRESS``,
    one ``[max | sum | mean]`` row a request, slot 1 + r) and its online plans; the bound adds
    the state's conversions (below)."""
    from sglang.kernels.ops.attention.dsv4 import CompressorDecodePlan, CompressorPrefillPlan
    from dsv4_backend.kernels import reference as R
    from bounds import U32, compress_bounds, compressed_row_bound, softmax_pool_bound
    assert ratio == 4 or not indexer, "the indexer compresses C4 rows only"
    assert ratio == 128 or not online, "online compression is C128's"
    layer = LAYER_OF_RATIO[ratio]
    d, coff = (128 if indexer else 512), (2 if ratio == 4 else 1)
    states = pool.get_indexer_compress_states(layer) if indexer else pool.get_attention_compress_states(layer)
    state = states.kv_score_buffer.kv_score
    state.copy_((torch.randn(state.shape, generator=g) * 2).to(state.dtype))
    before = state.cpu().clone()
    nreq = len(steps[0][1])
    lengths = [sum(step[1][r] for step in steps) for r in range(nreq)]
    raw = [torch.randn(n, 2 * coff * d, generator=g) * 2 for n in lengths]
    target = pool.get_index_k_with_scale_buffer(layer) if indexer else pool.get_extra_key_buffer(layer)
    rows_total = target.shape[0] * (64 if indexer else pool.get_extra_key_page_size(layer))
    blocks = [(r, b) for r in range(nreq) for b in range(lengths[r] // ratio)]
    dest_of = dict(zip(blocks, torch.randperm(rows_total, generator=g)[:len(blocks)].tolist()))
    ape = torch.randn(ratio, coff * d, generator=g)
    stored_ape = torch.cat([ape[:, :d], ape[:, d:]], 0).reshape(4, 2 * d) if ratio == 4 else ape
    w = torch.rand(d, generator=g) + 0.5
    angles = torch.randn(max(lengths) + 1, 32, generator=g, dtype=torch.float64)
    freqs = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    as_bytes(target).zero_()
    step_rows = {}
    compressor = NS(ratio=ratio, head_dim=d, is_in_indexer=indexer, rotate=indexer, ape=stored_ape.to(device),
                    ape_converted=True, norm=NS(weight=w.to(device), variance_epsilon=1e-6),
                    freqs_cis=freqs.to(device), compute_kv_score=lambda x, fb: step_rows["kv"],
                    get_state_pool=lambda backend: states)
    backend = make_backend(pool, enable_deepseek_v4_fp4_indexer=False)
    method = super(A.TritonDSV4AttnBackend, backend).forward_unified if sglang_kernels else backend.forward_unified
    done = [0] * nreq
    closing = lambda r, p: dest_of[(r, p // ratio)] if (p + 1) % ratio == 0 else -1
    for kind, new in steps:
        rids = [r for r in range(nreq) if new[r]]
        seq = [done[r] + new[r] for r in rids]
        step_rows["kv"] = torch.cat([raw[r][done[r]:done[r] + new[r]] for r in rids]).to(device)
        if kind == "extend" and online:
            plan = CompressorPrefillPlan(ratio, *online_prefill_plan(rids, seq, [new[r] for r in rids], 2, device))
            out_loc = [closing(r, p) for r in rids for p in range(done[r], done[r] + new[r])]
        elif kind == "extend":
            plan = CompressorPrefillPlan(ratio, *prefill_plan(ratio, rids, seq, [new[r] for r in rids], 2, device))
            out_loc = [closing(r, p) for r in rids for p in range(done[r], done[r] + new[r])]
        else:
            assert all(new[r] == 1 for r in rids)
            rows = [[s, 1 + r, 1 + r, -1] if online else
                    [s, ring_slot(ratio, r, s - 1), ring_slot(ratio, r, max(s - 1 - ratio, 0)) // ratio,
                     ring_slot(ratio, r, s - 1) // ratio] for r, s in zip(rids, seq)]
            plan = CompressorDecodePlan(ratio, torch.tensor(rows, dtype=torch.int32).view(torch.uint8).to(device))
            out_loc = [closing(r, s - 1) for r, s in zip(rids, seq)]
        backend.forward_metadata = NS(**{f"c{ratio}_compress_metadata": plan, "core_metadata": NS(
            **{f"c{ratio}_out_loc": torch.tensor(out_loc, dtype=torch.int64, device=device)})})
        method(torch.zeros(len(step_rows["kv"]), 8, device=device),
               NS(forward_mode=NS(is_idle=lambda: False), batch_size=len(rids)), layer, compressor)
        for r in rids:
            done[r] += new[r]

    offset = [sum(lengths[:r]) for r in range(nreq)]
    sequence = torch.cat(raw)
    sources = []
    for r, b in blocks:
        own = offset[r] + b * ratio + torch.arange(ratio)
        sources.append(torch.cat([own - 4 if b else torch.full((4,), -1), own]) if ratio == 4 else own)
    sources = torch.stack(sources)
    dest = torch.tensor([dest_of[blk] for blk in blocks])
    rot = freqs[torch.tensor([b * ratio for _, b in blocks])]
    ref_pool = torch.zeros(target.shape, dtype=torch.uint8)
    R.compress_ref(ref_pool, dest, sequence, sources, ape, w, rot.real.float(), rot.imag.float(), ratio,
                   indexer=indexer)
    if online:
        # our kernel keeps the unnormalised accumulator, SGLang's state the mean: at each step
        # boundary inside a block the running mean is rounded once out of and once into SGLang's
        # form, each within u of |mean| <= max_j |c_j|, and carried on with weight <= 1
        ring = list(range(1, nreq + 1))
        c, z = R.compress_candidates_ref(sequence, sources, ape, ratio, d)
        pooled = (torch.softmax(z.double(), dim=1) * c.double()).sum(1)
        d_pooled = softmax_pool_bound(c, z) + 2 * U32 * len(steps) * c.double().abs().amax(1)
        bound = compressed_row_bound(pooled, d_pooled, w, indexer, True)
    else:
        ring = sorted({ring_slot(ratio, r, p) for r in range(nreq) for p in range(lengths[r])})
        bound = compress_bounds(sequence, sources, ape, w, ratio, d, indexer)
    return dict(pool=as_bytes(target).cpu(), ref_pool=ref_pool, dest=dest, state=state.cpu(), before=before,
                ring=torch.tensor(ring), bound=bound, indexer=indexer)
