"""The CPU-side parts of the FlashMLA backend (flash_mla itself never imports here).

- the kernel choice: ``auto`` / ``flashmla`` / ``triton`` on the CPU and on a GPU-less CUDA
  device, the errors that name why, and the option's path through ModelRunner, Engine and the
  server flags;
- the byte view FlashMLA is given: ``flashmla_cache`` of a pool (aligned or not) addresses each
  slot's 576-byte part and 8-byte scale group exactly where ``pack_kv_page`` (memory/layout.py's
  documented page) puts them, without copying;
- 576-byte page alignment: the first P * 584 bytes of an aligned pool equal an unaligned pool's
  after the same writes, the tail stays zero, and the Triton sparse decode (interpreter) reads
  both to the same bits;
- the index padding (-1, to a multiple of 128) and the list lengths HCA passes;
- the engine's plumbing: a stand-in ``flash_mla`` (asserts, metadata contract, float64 decode
  from the bytes FlashMLA reads) drives the backend on aligned pools beside the Triton backend
  on plain pools, layer by layer: same pool bytes from every writer, same attention.

The device checks (FlashMLA against Triton and the reference, timing, teacher-forced engine
logits) are bench/gpu_flashmla_check.py on an H200.
"""

from __future__ import annotations

import sys

import pytest
import torch

from dsv4_backend.backend import AttentionBackend
from dsv4_backend.config import DSV4Config
from dsv4_backend.flashmla_backend import (
    FLASHMLA_PAGE_ALIGN, FlashMLADSV4Backend, flashmla_cache, list_lengths, pad_indices, padded_heads,
    prefill_workspace, resolve_attention_kernel,
)
from dsv4_backend.kernels.reference import sparse_decode_ref
from dsv4_backend.model_runner import ModelRunner, pool_page_align, run_schedule
from dsv4_backend.triton_backend import TritonDSV4Backend
from dsv4_backend.weights import random_weights
from memory.configurator import DSV4PoolConfigurator
from memory.layout import KV_ROW_BYTES, pack_kv_page, read_kv_rows, write_kv_rows
from memory.pools import DSV4KVPools

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answers of a machine without CUDA")
CFG = DSV4Config.preset("tiny", vocab_size=512, num_hidden_layers=3, compress_ratios=(0, 4, 128, 0))


def test_kernel_choice_on_the_cpu():
    assert resolve_attention_kernel("auto", "cpu", torch.float32)[0] == "torch"
    assert resolve_attention_kernel("triton", "cpu", torch.float32)[0] == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_attention_kernel("flashmla", "cpu", torch.float32)
    with pytest.raises(ValueError, match="attention_kernel must be one of"):
        resolve_attention_kernel("cutlass", "cpu", torch.float32)
    with pytest.raises(ValueError, match="float64"):
        resolve_attention_kernel("flashmla", "cuda", torch.float64)
    assert pool_page_align("flashmla") == FLASHMLA_PAGE_ALIGN and pool_page_align("triton") == 1


@no_cuda
def test_kernel_choice_without_a_gpu_falls_back_or_says_why():
    kernel, why = resolve_attention_kernel("auto", "cuda", torch.bfloat16)
    assert kernel == "triton" and "CUDA is not available" in why
    assert resolve_attention_kernel("triton", "cuda", torch.bfloat16) == ("triton", "asked for")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_attention_kernel("flashmla", "cuda", torch.bfloat16)


def test_backend_refuses_to_run_off_gpu():
    plan = DSV4PoolConfigurator(CFG, max_running_requests=2).plan_for_tokens(1024)
    pools = DSV4KVPools(CFG, plan, page_align=FLASHMLA_PAGE_ALIGN)
    with pytest.raises(ValueError, match="flashmla backend cannot run: FlashMLA needs a CUDA device"):
        FlashMLADSV4Backend(CFG, pools, None)


def test_runner_and_engine_options():
    runner = ModelRunner.build(CFG, max_total_tokens=1024, max_running_requests=2)
    assert runner.attention_kernel == runner.backend_name == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ModelRunner.build(CFG, max_total_tokens=1024, max_running_requests=2, attention_kernel="flashmla")
    with pytest.raises(ValueError, match="disagree"):
        ModelRunner.build(CFG, max_total_tokens=1024, max_running_requests=2, backend="torch",
                          attention_kernel="flashmla")

    from scheduler_hooks.engine import Engine
    eng = Engine(preset="tiny", max_total_tokens=1024, max_running_requests=2, skip_tokenizer_init=True,
                 config_overrides={"vocab_size": 512, "num_hidden_layers": 3, "compress_ratios": (0, 4, 128, 0)})
    try:
        assert eng.stats()["attention_kernel"] == "torch"
        assert eng.pools.page_align == 1
    finally:
        eng.shutdown()
    with pytest.raises(ValueError, match="attention_kernel='flashmla' needs a CUDA device"):
        Engine(preset="tiny", max_total_tokens=1024, max_running_requests=2, skip_tokenizer_init=True,
               attention_kernel="flashmla",
               config_overrides={"vocab_size": 512, "num_hidden_layers": 3, "compress_ratios": (0, 4, 128, 0)})


def test_server_flag():
    from server import parse_args
    assert "attention_kernel" not in parse_args([]).engine_kwargs()   # the engine's default: auto
    assert parse_args(["--attention-kernel", "triton"]).engine_kwargs()["attention_kernel"] == "triton"
    assert parse_args(["--attention-kernel", "flashmla"]).attention_kernel == "flashmla"
    with pytest.raises(SystemExit):
        parse_args(["--attention-kernel", "cutlass"])


@pytest.mark.parametrize("P,align", [(128, 1), (128, FLASHMLA_PAGE_ALIGN), (64, FLASHMLA_PAGE_ALIGN)])
def test_cache_view_addresses_the_documented_page(P, align):
    g = torch.Generator().manual_seed(P + align)
    pages = 3
    width = -(-(P * KV_ROW_BYTES) // align) * align
    pool = torch.zeros(pages, width, dtype=torch.uint8)
    rows = torch.randn(pages * P, 512, generator=g) * torch.exp2(torch.randint(-6, 6, (pages * P, 1), generator=g))
    write_kv_rows(pool, torch.arange(pages * P), rows)
    cache = flashmla_cache(pool, "test")
    assert cache.shape == (pages, P, 1, KV_ROW_BYTES) and cache.data_ptr() == pool.data_ptr()
    # FlashMLA's asserts: rows 584 bytes apart inside a block, blocks stride(0) apart
    assert cache.stride() == (width, KV_ROW_BYTES, KV_ROW_BYTES, 1)
    flat = pool.reshape(-1)
    for page in range(pages):
        want = pack_kv_page(rows[page * P:(page + 1) * P])     # [P * 576 parts | P * 8 scale groups]
        for r in (0, 1, P // 2, P - 1):
            part = page * cache.stride(0) + r * 576             # where the kernel reads row r's part
            group = page * cache.stride(0) + P * 576 + r * 8    # and its scale group
            assert torch.equal(flat[part:part + 576], want[r * 576:(r + 1) * 576])
            assert torch.equal(flat[group:group + 8], want[P * 576 + r * 8:P * 576 + (r + 1) * 8])
        # the view's own element [page, r, 0, j] sits at r * 584 + j: a shape for FlashMLA's
        # asserts, not row r's bytes (the kernel computes the offsets above); row 0 coincides
        assert torch.equal(cache[page, 0, 0, :576], want[:576])


def test_aligned_pools_hold_the_same_bytes_and_decode_the_same():
    plan = DSV4PoolConfigurator(CFG, max_running_requests=2).plan_for_tokens(1024)
    plain, aligned = DSV4KVPools(CFG, plan), DSV4KVPools(CFG, plan, page_align=FLASHMLA_PAGE_ALIGN)
    g = torch.Generator().manual_seed(1)
    for kind in ("swa_kv", "c4_kv", "c128_kv"):
        for layer, a in getattr(aligned, kind).items():
            p = getattr(plain, kind)[layer]
            assert a.shape[1] % FLASHMLA_PAGE_ALIGN == 0 and 0 <= a.shape[1] - p.shape[1] < FLASHMLA_PAGE_ALIGN
            n = p.shape[0] * (p.shape[1] // KV_ROW_BYTES)
            slots = torch.randperm(n, generator=g)[: n // 2]
            rows = torch.randn(slots.numel(), 512, generator=g)
            write_kv_rows(p, slots, rows)
            write_kv_rows(a, slots, rows)
            assert torch.equal(a[:, :p.shape[1]], p) and not a[:, p.shape[1]:].any()
    for kind in ("c4_indexer",):
        for layer, a in getattr(aligned, kind).items():
            assert a.shape == getattr(plain, kind)[layer].shape   # indexer pages are not FlashMLA's

    from dsv4_backend.kernels.sparse_attention import sparse_decode
    swa_p, swa_a = plain.swa_kv[0], aligned.swa_kv[0]
    ext_p, ext_a = plain.c4_kv[1], aligned.c4_kv[1]
    win = torch.randint(0, swa_p.shape[0] * 128, (2, 8), generator=g, dtype=torch.int32)
    ext = torch.randint(0, ext_p.shape[0] * 64, (2, 8), generator=g, dtype=torch.int32)
    q, sink = torch.randn(2, 16, 512, generator=g), torch.randn(16, generator=g)
    a = sparse_decode(q, swa_a, win, ext_a, ext, sink, 512 ** -0.5)
    b = sparse_decode(q, swa_p, win, ext_p, ext, sink, 512 ** -0.5)
    assert torch.equal(a.out, b.out) and torch.equal(a.lse, b.lse)


def test_index_padding_and_lengths():
    idx = torch.tensor([[5, -1, 7], [-1, -1, -1], [1, 2, -1]], dtype=torch.int32)
    padded = pad_indices(idx)
    assert padded.shape == (3, 128) and padded.dtype == torch.int32 and padded.is_contiguous()
    assert torch.equal(padded[:, :3], idx) and (padded[:, 3:] == -1).all()
    assert pad_indices(torch.zeros(2, 0, dtype=torch.int32)).shape == (2, 128)
    assert pad_indices(torch.zeros(1, 129, dtype=torch.int32)).shape == (1, 256)
    assert list_lengths(padded).tolist() == [3, 0, 2]   # one past the last valid entry
    assert list_lengths(torch.zeros(2, 0, dtype=torch.int32)).tolist() == [0, 0]
    assert [padded_heads(h) for h in (1, 8, 64, 65, 128)] == [64, 64, 64, 128, 128]
    with pytest.raises(ValueError, match="at most 128"):
        padded_heads(129)


def test_prefill_workspace_points_every_list_entry_at_its_key():
    g = torch.Generator().manual_seed(2)
    swa = torch.zeros(3, 128 * KV_ROW_BYTES, dtype=torch.uint8)
    c4 = torch.zeros(2, 65 * 576, dtype=torch.uint8)
    write_kv_rows(swa, torch.arange(384), torch.randn(384, 512, generator=g))
    write_kv_rows(c4, torch.arange(128), torch.randn(128, 512, generator=g) * 8)
    T = 6   # consecutive query rows share most of their window, as in a prefill chunk
    window = (torch.arange(T)[:, None] + torch.arange(16)[None, :] + 100).to(torch.int32)
    window[0, :5] = -1
    extra = torch.randint(0, 128, (T, 10), generator=g, dtype=torch.int32)
    extra[:, ::4] = -1
    kv, idx = prefill_workspace(swa, window, c4, extra)
    assert kv.dtype == torch.bfloat16 and kv.shape[1:] == (1, 512) and idx.shape == (T, 1, 128)
    assert kv.shape[0] <= (T + 15 + 1) + (10 * T + 1)   # each distinct key (and one -1 row) per list once
    want = torch.cat([read_kv_rows(swa, window.long()), read_kv_rows(c4, extra.long())], 1)
    ids = idx[:, 0, :26].long()
    got = torch.where((ids >= 0)[..., None], kv[ids.clamp_min(0), 0].float(), 0.0)
    assert torch.equal(got, want)                         # bf16 holds every key value exactly
    assert torch.equal(ids < 0, torch.cat([window, extra], 1) < 0) and (idx[:, 0, 26:] == -1).all()


# ---- the engine's plumbing, driven by a stand-in for flash_mla ---------------------------------

class StandInFlashMLA:
    """``flash_mla`` for the CPU: checks what the backend hands ``flash_mla_with_kvcache``
    against the kernel's asserts and contract, and computes its V4 sparse decode in float64
    from the cache bytes at the offsets FlashMLA reads (part at ``block * stride(0) + row *
    576``, scale group at ``block * stride(0) + P * 576 + row * 8``). Entries of the extra list
    at or past ``extra_topk_length`` are skipped, as in the kernel. A scheduling metadata
    object reused by a later call must see the same shapes and lengths (its contract)."""

    def __init__(self):
        self.calls, self.reuses = 0, 0

    class Sched:
        def __init__(self):
            self.key = None

    def get_mla_metadata(self):
        return self.Sched(), None

    @staticmethod
    def _cache_rows(cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        nb, P = cache.shape[:2]
        assert cache.dim() == 4 and cache.shape[2:] == (1, KV_ROW_BYTES) and cache.dtype == torch.uint8
        assert cache.stride(1) == cache.stride(2) == KV_ROW_BYTES and cache.stride(0) % FLASHMLA_PAGE_ALIGN == 0
        flat = torch.as_strided(cache, (nb, cache.stride(0)), (cache.stride(0), 1))
        i = idx.long().clamp_min(0)
        block, row = i // P, i % P
        part_at = row[..., None] * 576 + torch.arange(576)
        group_at = P * 576 + row[..., None] * 8 + torch.arange(8)
        part, group = flat[block[..., None], part_at], flat[block[..., None], group_at]
        nope = part[..., :448].contiguous().view(torch.float8_e4m3fn).double().unflatten(-1, (7, 64))
        nope = nope * torch.exp2(group[..., :7].double() - 127)[..., None]
        rope = part[..., 448:].contiguous().view(torch.bfloat16).double()
        return torch.cat([nope.flatten(-2), rope], -1)

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, sched, *,
                               softmax_scale, is_fp8_kvcache, indices, attn_sink, use_legacy, kv_format,
                               extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None):
        b, s_q, hp, d = q.shape
        assert (s_q, d, head_dim_v, hp in (64, 128)) == (1, 512, 512, True), q.shape
        assert block_table is None and cache_seqlens is None and is_fp8_kvcache and use_legacy and kv_format == "V4"
        assert attn_sink.dtype == torch.float32 and attn_sink.shape == (hp,)
        lists = [(k_cache, indices, None)]
        if extra_k_cache is not None:
            lists.append((extra_k_cache, extra_indices_in_kvcache, extra_topk_length))
        keys, valid = [], []
        for cache, idx, length in lists:
            assert idx.dtype == torch.int32 and idx.shape[:2] == (b, 1) and idx.shape[2] % 64 == 0, idx.shape
            idx = idx[:, 0]
            ok = idx >= 0
            if length is not None:
                assert length.dtype == torch.int32 and length.shape == (b,)
                ok &= torch.arange(idx.shape[1])[None, :] < length[:, None]
            keys.append(self._cache_rows(cache, idx))
            valid.append(ok)
        key = (tuple(q.shape), tuple(tuple(t.shape) for _, t, _ in lists),
               None if extra_topk_length is None else tuple(extra_topk_length.tolist()))
        if sched.key is None:
            sched.key = key
        else:
            assert sched.key == key, "scheduling metadata reused for a call of another shape or lengths"
            self.reuses += 1
        self.calls += 1
        keys, valid = torch.cat(keys, 1), torch.cat(valid, 1)
        s = torch.einsum("bhd,bnd->bhn", q[:, 0].double(), keys) * softmax_scale
        s = s.masked_fill(~valid[:, None], float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.logaddexp(lse, attn_sink.double())[..., None])
        out = torch.einsum("bhn,bnd->bhd", p, keys).masked_fill(torch.isneginf(lse)[..., None], 0.0)
        return out[:, None].to(q.dtype), lse.masked_fill(torch.isneginf(lse), float("inf")).float()[..., None]


class Float64Triton(TritonDSV4Backend):
    """The Triton backend with its attention in float64 (``sparse_decode_ref``) on its own, unpadded pools."""

    def _sparse_attention(self, ratio, q, swa_pool, plan, extra_pool, extra_rows, attn_sink):
        return sparse_decode_ref(q, swa_pool, plan.window_slots, extra_pool, extra_rows, attn_sink,
                                 self.cfg.softmax_scale).out.to(q.dtype)


class PairedBackends(AttentionBackend):
    """Runs the reference and the FlashMLA backend on the same metadata and inputs, each on its
    own pools, compares each layer's writes and attention, and returns the reference's output."""

    def __init__(self, ref: TritonDSV4Backend, test: FlashMLADSV4Backend):
        self.ref, self.test, self.layers_seen = ref, test, set()

    def init_forward_metadata(self, batch):
        return self.ref.init_forward_metadata(batch)

    def forward(self, layer_id, layer, inputs, meta):
        o_ref = self.ref.forward(layer_id, layer, inputs, meta)
        o_test = self.test.forward(layer_id, layer, inputs, meta)
        # the same Triton writers on the same values: the padded pages hold the unpadded bytes
        for kind in ("swa_kv", "c4_kv", "c128_kv"):
            plain = getattr(self.ref.pools, kind).get(layer_id)
            if plain is not None:
                padded = getattr(self.test.pools, kind)[layer_id]
                assert torch.equal(padded[:, :plain.shape[1]], plain), f"{kind}[{layer_id}] bytes differ"
                assert not padded[:, plain.shape[1]:].any(), f"{kind}[{layer_id}]: a write landed in the padding"
        for kind in ("c4_indexer", "c4_ring", "c4_indexer_ring", "c128_ring"):
            if layer_id in getattr(self.ref.pools, kind):
                assert torch.equal(getattr(self.ref.pools, kind)[layer_id], getattr(self.test.pools, kind)[layer_id])
        # both are one float32 rounding of a float64 softmax over the same keys (the padding
        # adds exact zeros): within one float32 ulp of each other, plus the float64 sums' error
        v_max = max(float(read_kv_rows(p, torch.arange(p.shape[0] * (p.shape[1] // KV_ROW_BYTES))).abs().max())
                    for p in (self.ref.pools.swa_kv[layer_id],))
        bound = 2.0 ** -23 * o_ref.abs() + 2.0 ** -40 * (1 + v_max)
        assert torch.all((o_ref - o_test).abs() <= bound), \
            f"layer {layer_id} (ratio {layer.ratio}): FlashMLA path differs by {float((o_ref - o_test).abs().max()):.3e}"
        self.layers_seen.add(layer.ratio)
        return o_ref


def test_standin_flashmla_drives_the_engine_like_the_triton_backend(monkeypatch):
    """The FlashMLA backend's plumbing on padded pools (every Triton writer: KV store,
    compressors, indexer; the cache views; -1 / head / index padding; HCA's per-row lengths in a
    prefill crossing 128; the per-kind scheduling metadata reused across layers and steps)
    against the Triton backend on unpadded pools, layer by layer, over chunked prefill, a batch
    of two and decodes crossing 4 and 128."""
    import dsv4_backend.flashmla_backend as fb
    fm = StandInFlashMLA()
    monkeypatch.setitem(sys.modules, "flash_mla", fm)
    monkeypatch.setattr(fb, "flashmla_unavailable", lambda *a, **k: None)
    cfg = DSV4Config.preset("tiny", vocab_size=512, num_hidden_layers=4, compress_ratios=(0, 4, 128, 128, 0),
                            index_topk=4)
    weights = random_weights(cfg, seed=3, dtype=torch.float32, include_mtp=False)
    runner = ModelRunner.build(cfg, dtype=torch.float32, weights=weights, backend="triton",
                               max_total_tokens=2048, max_running_requests=2)
    padded = DSV4KVPools(cfg, runner.pools.plan, state_dtype=runner.pools.state_dtype,
                         page_align=FLASHMLA_PAGE_ALIGN)
    ref = Float64Triton(cfg, runner.pools, runner.allocator, dtype=torch.float32)
    pair = PairedBackends(ref, FlashMLADSV4Backend(cfg, padded, runner.allocator, dtype=torch.float32))
    runner.backend = pair
    g = torch.Generator().manual_seed(4)
    seqs = {r: torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for r, n in (("a", 136), ("b", 36))}
    # a: 130 tokens in chunks of 70 + 60 (its rows before / after 128 see 0 / 1 C128 rows),
    # b joins with 30; then both decode (a's C4 blocks complete at 132 and 136)
    run_schedule(runner, [[("a", 70)], [("a", 60), ("b", 30)]] + [[("a", 1), ("b", 1)]] * 6, seqs)
    assert pair.layers_seen == {0, 4, 128}
    # two HCA layers per step share one metadata object; SWA-only and CSA run once a step each
    assert fm.calls == 8 * 4 and fm.reuses == 8
