"""Our Triton kernels on SGLang 0.5.23's CUDA pools, against our fp64 reference and SGLang's kernels.

    bash bench/gpu_sglang_session.sh $OUT     # unpacks the carried SGLang wheels, runs this file

or by hand, with SGLang importable (its wheel and its imports' wheels unpacked into /tmp/sgl):

    PYTHONPATH=/tmp/sgl:. SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1 python3 bench/gpu_sglang_check.py --out $OUT

torch and triton are the machine's. ``sgl_kernel`` (SGLang's CUDA kernel package, which SGLang
imports at module level on CUDA) is not needed: where it does not import, ``import_sglang``
puts the stand-in of bench/sgl_stubs first on ``sys.path`` (bench/sglang_stubs.py; a test
harness whose every function raises when called) and says so; the end of the run lists the
``sgl_kernel`` names SGLang imported from it and any it called. On a CPU,
``python bench/sglang_cuda_branch.py`` runs ``--tiny`` with SGLang on its CUDA import branch.

1. install: which SGLang imports and the device;
2. SGLang's pools built on the GPU by SGLang's classes (SWA 256-row pages of 149,760 B, C4
   64-row pages of 37,440 B, C128 2-row pages of 1,728 B, indexer 64-row pages of 8,448 B);
3. the KV store: ``kv_store_rows`` into SGLang's SWA and C4 pools, bit-exact against
   ``memory.layout.write_kv_rows`` (order-free quantisation) and against SGLang's own stores:
   ``set_key_buffer_fused`` (its JIT kernel, needs nvcc) and ``triton_fused_store_flashmla``
   (its Triton store, SGLang's ROCm path; GPU only) where they build; the plugin's
   ``TritonDSV4AttnBackend.store_cache`` on a full SGLang SWA pool;
4. sparse decode (window in SGLang SWA pages, top-k in SGLang C4 pages; Flash h64 top-k 512,
   Pro h128 top-k 1024) and the indexer scores on SGLang's indexer pages, against the fp64
   references within the bounds of tests/bounds.py;
5. TritonDSV4AttnBackend's methods on SGLang's CUDA DeepSeekV4TokenToKVPool and DSV4AttnMetadata
   (the cases of tests/sglang_cases.py): ``forward`` for ratios 0 / 4 / 128 (Flash h64 top-k 512,
   Pro h128 top-k 1024) against float64 and, where they run, SGLang's Triton sparse decode and
   FlashMLA; ``forward_c4_indexer`` against float64 and SGLang's torch indexer; the C4 decode
   compressors (attention and indexer) and the C128 one against the reference chain and
   SGLang's JIT compressor; the same compressors over extend steps (SGLang's prefill plans:
   prompts ending mid-block, second chunks reading the ring) then decode steps closing the
   next blocks, against the chain on the whole raw sequence and SGLang's JIT compressor run
   on the same steps; online C128 (its online state and plans) the same way.

Prints one line per check (PASS / FAIL / SKIP with the figures beside their bound), then INFO
lines: SGLang's kernel modules that did not import, which of SGLang's kernels each comparison ran
against and which did not run (with the first reason), the stand-ins' names; writes
``gpu_sglang_check.json`` under ``--out``. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace as NS

import torch

if not torch.cuda.is_available():  # --tiny dry run on a CPU, kernels under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests", ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CHECKS: list[dict] = []
TINY = False


# SGLang's modules the checks import: without one of these no check of SGLang's pools runs.
SGLANG_MODULES = (
    "sglang.srt.mem_cache.deepseek_v4_memory_pool",
    "sglang.srt.runtime_context",
    "sglang.srt.layers.attention.deepseek_v4_backend",
    "sglang.srt.layers.attention.dsv4.indexer",
    "sglang.srt.layers.attention.dsv4.unified_kv_gate",
    "sglang.kernels.ops.attention.dsv4",
    "sglang.kernels.ops.attention.dsv4.kv_layout",
)
# SGLang's kernels the checks compare against, each in its own module: a module that does not
# import turns its comparisons into SKIPs with the reason.
SGLANG_KERNEL_MODULES = (
    "sglang.kernels.ops.attention.dsv4.attn",  # JIT store (set_key_buffer_fused)
    "sglang.kernels.ops.attention.dsv4.compress",  # JIT compressor (forward_unified)
    "sglang.kernels.ops.kvcache.triton_store_cache",  # Triton store
    "sglang.kernels.ops.attention.dsv4.triton_sparse_decode",  # Triton sparse decode
    "sglang.kernels.ops.attention.flash_mla_interface",  # FlashMLA: needs the flash_mla package
)


def import_sglang() -> dict:
    """Import stand-ins where SGLang's CUDA packages are missing (bench/sglang_stubs.py), then
    the plugin and SGLang's modules of SGLANG_MODULES (an import error propagates) and of
    SGLANG_KERNEL_MODULES. Returns {"stand_ins": {package: why}, "kernel_modules": {module:
    "ok" or the import error}, "cuda_branch": SGLang's is_cuda()}."""
    import sglang_stubs
    stand_ins = sglang_stubs.install()
    for name, why in stand_ins.items():
        print(f"stand-in for {name} ({sglang_stubs.STUB_DIR}, a test harness: each of its functions "
              f"raises when called): {why}", flush=True)
    import dsv4_backend.sglang_adapter  # noqa: F401  stubs torchvision when absent, then imports SGLang
    for module in SGLANG_MODULES:
        importlib.import_module(module)
    kernels = {}
    for module in SGLANG_KERNEL_MODULES:
        try:
            importlib.import_module(module)
            kernels[module] = "ok"
        except Exception as e:
            kernels[module] = one_line(e)
    import sglang_cases  # noqa: F401
    from sglang.srt.utils import is_cuda
    return {"stand_ins": stand_ins, "kernel_modules": kernels, "cuda_branch": is_cuda()}


def sglang_kernel_summary() -> tuple[dict, dict]:
    """SGLang's kernels the checks compared against: {kernel: [PASS / FAIL per check]} for
    those that ran, {kernel: first SKIP reason} for those that did not."""
    ran, not_run = {}, {}
    for c in CHECKS:
        against = re.search(r" (?:vs|and) (SGLang's .*)$", c["name"])
        if against is None or c["status"] not in ("PASS", "FAIL", "SKIP"):
            continue
        kernel = against.group(1)
        if c["status"] == "SKIP":
            not_run.setdefault(kernel, c.get("reason", ""))
        else:
            ran.setdefault(kernel, []).append(c["status"])
    return ran, {k: v for k, v in not_run.items() if k not in ran}


def record(name: str, status: str, **info) -> None:
    CHECKS.append({"name": name, "status": status, **info})
    print(f"{status:4s} {name}: " + ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)


def one_line(e: BaseException) -> str:
    """An exception in one line: its start and its end (a failed JIT build ends with the compiler's error)."""
    text = " | ".join(line for line in f"{type(e).__name__}: {e}".splitlines() if line.strip())
    return text if len(text) <= 600 else f"{text[:200]} ... {text[-400:]}"


def guarded(name: str, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # a failed check must not hide the others
        record(name, "FAIL", error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=4)[-800:])


def sglang_pools(swa_tokens: int, full_tokens: int):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4IndexerPool, DeepSeekV4SingleKVPool
    from sglang.srt.runtime_context import get_context
    with get_context().override_server_args(page_size=256):
        kv = dict(dtype=torch.float8_e4m3fn, qk_nope_head_dim=448, qk_rope_head_dim=64, layer_num=1,
                  device=DEV, enable_memory_saver=False, global_page_size=256)
        swa = DeepSeekV4SingleKVPool(swa_tokens, 256, **kv)
        c4 = DeepSeekV4SingleKVPool(full_tokens // 4, 64, **kv)
        c128 = DeepSeekV4SingleKVPool(full_tokens // 128, 2, **kv)
        idx = DeepSeekV4IndexerPool(full_tokens // 4, 64, torch.float8_e4m3fn, 128, 1, DEV, False,
                                    use_fp4_indexer=False, global_page_size=256)
    return swa, c4, c128, idx


def check_pages(pools) -> None:
    swa, c4, c128, idx = pools
    got = (swa.kv_buffer[0].shape[1], c4.kv_buffer[0].shape[1], c128.kv_buffer[0].shape[1],
           idx.index_k_with_scale_buffer[0].shape[1])
    want = (149_760, 37_440, 1_728, 8_448)
    record("sglang page bytes", "PASS" if got == want else "FAIL", got=got, want=want)


def check_store(name: str, pool, rows_per_page: int, g: torch.Generator) -> None:
    from dsv4_backend.kernels.kv_store import kv_store_rows
    from memory.layout import write_kv_rows
    buf = pool.kv_buffer[0]
    n = min(64 if TINY else 4096, (buf.shape[0] - 1) * rows_per_page)
    slots = torch.randperm((buf.shape[0] - 1) * rows_per_page, generator=g)[:n]
    rows = (torch.randn(n, 512, generator=g) * torch.exp2(torch.randint(-12, 8, (n, 1), generator=g))).bfloat16()
    ours = torch.zeros_like(buf)
    kv_store_rows(ours, slots.to(DEV).int(), rows.to(DEV))
    ref = torch.zeros(buf.shape, dtype=torch.uint8)
    write_kv_rows(ref, slots, rows.double())
    diff = int((ours.cpu() != ref).sum())
    record(f"{name}: kv_store_rows vs layout reference", "PASS" if diff == 0 else "FAIL",
           rows=n, differing_bytes=diff, bound=0)
    for kernel, store in SGLANG_STORES:
        label = f"{name}: vs {kernel}"
        if kernel in GPU_ONLY and DEV != "cuda":
            record(label, "SKIP", reason=GPU_ONLY[kernel])
            continue
        try:
            buf.zero_()
            store(pool, buf, slots.to(DEV), rows.to(DEV), rows_per_page)
            theirs = buf.cpu()
        except Exception as e:
            record(label, "SKIP", reason=one_line(e))
            continue
        mism = (theirs != ours.cpu())
        record(label, "PASS" if not mism.any() else "FAIL", rows=n, differing_bytes=int(mism.sum()),
               pages_with_differences=int(mism.any(1).sum()), bound=0)


def _sglang_jit_store(pool, buf, slots, rows, rows_per_page):
    pool.set_key_buffer_fused(0, slots.long(), rows)


def _sglang_triton_store(pool, buf, slots, rows, rows_per_page):
    from sglang.kernels.ops.kvcache.triton_store_cache import triton_fused_store_flashmla
    triton_fused_store_flashmla(rows, buf, slots.long(), rows_per_page)


SGLANG_STORES = (("SGLang's set_key_buffer_fused", _sglang_jit_store),
                 ("SGLang's Triton store (triton_fused_store_flashmla, its ROCm path)", _sglang_triton_store))
# Under the Triton interpreter SGLang's Triton store casts to FP8 unlike a GPU does (tried on the
# CPU: values off by up to 2x), so its bytes are compared on a GPU only.
GPU_ONLY = {SGLANG_STORES[1][0]: "no GPU (the interpreter's FP8 cast is not the GPU's)"}


def check_backend_store(pools, g) -> None:
    import dsv4_backend.sglang_adapter as A
    from memory.layout import write_kv_rows
    swa = pools[0].kv_buffer[0]
    swa.zero_()
    backend = object.__new__(A.TritonDSV4AttnBackend)
    backend.pre_kv_store_hook = None
    n = 16 if TINY else 1000
    locs = torch.randperm((swa.shape[0] - 1) * 256, generator=g)[:n].int()
    backend.forward_metadata = NS(core_attn_metadata=NS(swa_out_cache_loc=locs.to(DEV)))
    backend.token_to_kv_pool = NS(request_window=None, get_swa_raw_buffer=lambda layer_id: swa)
    batch = NS(out_cache_loc=torch.zeros(n, device=DEV), forward_mode=NS(is_idle=lambda: False))
    rows = torch.randn(n, 512, generator=g).bfloat16()
    backend.store_cache(0, rows.to(DEV), batch)
    ref = torch.zeros(swa.shape, dtype=torch.uint8)
    write_kv_rows(ref, locs.long(), rows.double())
    diff = int((swa.cpu() != ref).sum())
    record("TritonDSV4AttnBackend.store_cache on SGLang's SWA pool", "PASS" if diff == 0 else "FAIL",
           differing_bytes=diff, bound=0)


def fill(pool_buf, rows_per_page: int, g, scale=2.0) -> None:
    from memory.layout import write_kv_rows
    n = pool_buf.shape[0] * rows_per_page
    host = torch.zeros(pool_buf.shape, dtype=torch.uint8)
    write_kv_rows(host, torch.arange(n), torch.randn(n, 512, generator=g) * scale)
    pool_buf.copy_(host)


def check_decode(name: str, pools, h: int, k: int, b: int, g) -> None:
    from bounds import assert_within, attention_bound
    from dsv4_backend.kernels import reference as R
    from dsv4_backend.kernels.sparse_attention import sparse_decode
    from memory.layout import read_kv_rows
    swa, c4 = pools[0].kv_buffer[0], pools[1].kv_buffer[0]
    fill(swa, 256, g)
    fill(c4, 64, g)
    win = torch.randint(0, swa.shape[0] * 256, (b, 128), generator=g, dtype=torch.int32)
    win[0, 100:] = -1
    ext = torch.randint(0, c4.shape[0] * 64, (b, k), generator=g, dtype=torch.int32)
    ext[1, ::7] = -1
    q = (torch.randn(b, h, 512, generator=g) * 3).bfloat16()
    sink = torch.randn(h, generator=g)
    scale = 512 ** -0.5
    got = sparse_decode(q.to(DEV), swa, win.to(DEV), c4, ext.to(DEV), sink.to(DEV), scale)
    ref = R.sparse_decode_ref(q.float(), swa.cpu(), win, c4.cpu(), ext, sink, scale)
    keys = torch.cat([read_kv_rows(swa.cpu(), win.clamp_min(0).long()),
                      read_kv_rows(c4.cpu(), ext.clamp_min(0).long())], 1)
    valid = torch.cat([win >= 0, ext >= 0], 1)
    out_b, lse_b = attention_bound(q.float(), keys, valid, sink, scale, bf16_p=True,
                                   bf16_out=got.out.dtype == torch.bfloat16)
    err = (got.out.cpu().float() - ref.out.float()).abs()
    worst = float((err / out_b).max())
    try:
        assert_within(got.out.cpu(), ref.out, out_b, "out")
        assert_within(got.lse.cpu(), ref.lse, lse_b, "lse")
        status = "PASS"
    except AssertionError:
        status = "FAIL"
    record(f"sparse decode on SGLang SWA + C4 pages ({name})", status, b=b, h=h, topk=k,
           max_err=f"{float(err.max()):.3g}", worst_err_over_bound=f"{worst:.3g}", bound="<= 1")


def check_indexer(pools, g) -> None:
    from bounds import assert_within, indexer_score_bound
    from dsv4_backend.kernels import reference as R
    from dsv4_backend.kernels.indexer import indexer_scores
    from memory.layout import read_indexer_rows, write_indexer_rows
    from memory.quant import indexer_fake_quant
    idx = pools[3].index_k_with_scale_buffer[0]
    n = idx.shape[0] * 64
    host = torch.zeros(idx.shape, dtype=torch.uint8)
    write_indexer_rows(host, torch.arange(n), torch.randn(n, 128, generator=g))
    idx.copy_(host)
    b, h, L = (2, 4, 64) if TINY else (8, 64, 4096)
    q = indexer_fake_quant(torch.randn(b, h, 128, generator=g))
    w = torch.randn(b, h, generator=g)
    row_ids = torch.randint(0, n, (b, L), generator=g)
    row_ids[0, 3000:] = -1
    got = indexer_scores(q.to(DEV), w.to(DEV), idx, row_ids=row_ids.to(DEV)).cpu()
    ref = R.indexer_scores_ref(q, w, host, row_ids)
    bound = indexer_score_bound(q, w, read_indexer_rows(host, row_ids.clamp_min(0).long()))
    finite = torch.isfinite(ref)
    worst = float(((got - ref).abs()[finite] / bound.expand_as(ref)[finite]).max())
    try:
        assert_within(got, ref, bound, "scores")
        status = "PASS"
    except AssertionError:
        status = "FAIL"
    record("indexer scores on SGLang indexer pages", status, b=b, h=h, rows=L,
           worst_err_over_bound=f"{worst:.3g}", bound="<= 1")


def _worst(got, want, bound) -> float:
    return float(((got.double() - want.double()).abs() / bound.clamp_min(1e-300)).max())


def _flashmla_form(inp):
    """SGLang's FlashMLA call form of an attention case: q [T, 1, h, 512], caches viewed
    [pages, P, 1, 584] (the kernel reads the format from the 584), lists [T, 1, n]."""
    def view(buf, P):
        return buf[:, :P * 584].view(buf.shape[0], P, 1, 584)
    kw = dict(q=inp["q"].unsqueeze(1), k_cache=view(inp["swa"], 256), head_dim_v=512,
              softmax_scale=512 ** -0.5, indices=inp["swa_idx"].unsqueeze(1),
              topk_length=inp["swa_len"], attn_sink=inp["sink"])
    if inp["extra"] is not None:
        P = inp["extra"].shape[1] // 584
        kw.update(extra_k_cache=view(inp["extra"], P), extra_indices_in_kvcache=inp["ext_idx"].unsqueeze(1),
                  extra_topk_length=inp["ext_len"])
    return kw


def _sglang_triton_decode(inp):
    from sglang.kernels.ops.attention.dsv4.triton_sparse_decode import triton_fp8_attention_fwd
    return triton_fp8_attention_fwd(**_flashmla_form(inp))[0]


def _sglang_flashmla_decode(inp):
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_with_kvcache, get_mla_metadata
    return flash_mla_with_kvcache(block_table=None, cache_seqlens=None,
                                  tile_scheduler_metadata=get_mla_metadata()[0], is_fp8_kvcache=True,
                                  use_legacy=True, **_flashmla_form(inp))[0]


SGLANG_DECODES = (("SGLang's Triton sparse decode (triton_fp8_attention_fwd)", _sglang_triton_decode),
                  ("SGLang's FlashMLA (flash_mla_with_kvcache)", _sglang_flashmla_decode))


def check_backend_attention(name: str, pool, ratio: int, T: int, h: int, width: int, g) -> None:
    """TritonDSV4AttnBackend.forward on SGLang's pool + DSV4AttnMetadata (tests/sglang_cases.py)."""
    import sglang_cases as C
    lens = lambda hi: torch.randint(1, hi + 1, (T + 1,), generator=g).tolist()  # noqa: E731
    case = C.attention_case(pool, ratio, g, T=T, H=h, heads=h, swa_lengths=lens(128), extra_width=width,
                            extra_lengths=lens(width) if ratio else None, device=DEV,
                            gpu_arithmetic=DEV == "cuda")
    worst = _worst(case["got"], case["want"], case["bound"])
    label = f"backend attention, ratio {ratio} ({name})"
    record(f"{label} vs fp64", "PASS" if worst <= 1 else "FAIL", T=T, h=h, extra=width,
           worst_err_over_bound=f"{worst:.3g}", bound="<= 1")
    for kernel, fn in SGLANG_DECODES:
        if DEV != "cuda":
            record(f"{label} vs {kernel}", "SKIP", reason="no GPU")
            continue
        try:
            theirs = fn(case["sglang_inputs"]).squeeze(1).float().cpu()
        except Exception as e:
            record(f"{label} vs {kernel}", "SKIP", reason=one_line(e))
            continue
        # both are within their own bf16-P bound of the fp64 result (assumed of theirs)
        w = _worst(case["got"], theirs, 2 * case["bound"])
        w_ref = _worst(theirs, case["want"], case["bound"])
        record(f"{label} vs {kernel}", "PASS" if w <= 1 else "FAIL", worst_diff_over_2bounds=f"{w:.3g}",
               theirs_vs_fp64_over_bound=f"{w_ref:.3g}", bound="<= 1")


def check_backend_indexer(name: str, pool, T: int, h: int, k: int, pages: int, g) -> None:
    """TritonDSV4AttnBackend.forward_c4_indexer vs fp64 and SGLang's own torch indexer."""
    import sglang_cases as C
    visible = torch.randint(1, pages * 64 + 1, (T,), generator=g)
    visible[: T // 4] = torch.randint(1, k + 1, (T // 4,), generator=g)  # fewer than top-k
    case = C.indexer_case(pool, g, T=T, H=h, k=k, visible=visible.tolist(), pages=pages, device=DEV)
    bad = C.indexer_findings(case)
    same = sum(set(a.tolist()) == set(b.tolist()) for a, b in zip(case["ours"], case["theirs"]))
    record(f"backend C4 indexer top-k ({name}) vs fp64 and SGLang's torch indexer",
           "PASS" if not bad else "FAIL", T=T, h=h, topk=k, rows=pages * 64,
           queries_with_identical_sets=f"{same}/{T}", findings=len(bad), first=bad[:3], bound="0 findings")


def check_backend_compressor(name: str, pool, indexer: bool, bs: int, g, ratio: int = 4) -> None:
    """forward_core_compressor / forward_indexer_compressor on a C4 or C128 decode step (our
    compressor on SGLang's state ring, DecodePlan and pools) against the fp32 reference chain,
    and against SGLang's own forward_unified (JIT compress_forward + compress_norm_rope_store)
    on the same inputs where its JIT kernels build."""
    import sglang_cases as C
    from bounds import assert_indexer_pools_close, assert_kv_pools_close
    close = assert_indexer_pools_close if indexer else assert_kv_pools_close
    seed = int(torch.randint(0, 1 << 30, (1,), generator=g))
    lengths = torch.randint(ratio, 4000, (bs,), generator=torch.Generator().manual_seed(seed))
    seq_lens = (lengths // ratio * ratio).tolist()
    seq_lens[1::3] = [s + 1 for s in seq_lens[1::3]]  # a third of the requests close no block
    seq_lens[0] = ratio  # a first block (C4: no previous one)
    what = "indexer" if indexer else f"C{ratio} attention"
    case = C.compressor_case(pool, torch.Generator().manual_seed(seed), indexer, seq_lens, device=DEV,
                             ratio=ratio)
    label = f"backend {what} compressor, decode ({name}, {bs} requests, {len(case['dest'])} closing)"
    try:
        assert torch.equal(case["state"], case["want_state"]), "state ring"
        close(case["pool"], case["ref_pool"], case["dest"], case["bound"], "rows")
        record(f"{label} vs reference", "PASS", bound="pre-rounding bound + one format step")
    except AssertionError as e:
        record(f"{label} vs reference", "FAIL", error=str(e)[:300])
    if DEV != "cuda":
        record(f"{label} vs SGLang's JIT compressor", "SKIP", reason="no GPU")
        return
    try:
        theirs = C.compressor_case(pool, torch.Generator().manual_seed(seed), indexer, seq_lens,
                                   device=DEV, sglang_kernels=True, ratio=ratio)
    except Exception as e:
        record(f"{label} vs SGLang's JIT compressor", "SKIP", reason=one_line(e))
        return
    try:
        assert torch.equal(case["state"], theirs["state"]), "state ring"
        close(case["pool"], theirs["pool"], case["dest"], 2 * case["bound"], "rows")
        record(f"{label} vs SGLang's JIT compressor", "PASS", bound="2 x pre-rounding bound + one format step")
    except AssertionError as e:
        record(f"{label} vs SGLang's JIT compressor", "FAIL", error=str(e)[:300])


def prefill_steps(ratio: int, bs: int, seed: int) -> list[tuple[str, list[int]]]:
    """Two extend steps (a prompt, then a second chunk for about two thirds of the requests)
    and decode steps, random lengths; request 0's prompt ends one token short of a block (C4:
    two), so a decode step closes its next block from the ring the extend steps left."""
    g = torch.Generator().manual_seed(seed)
    longest = (40, 20) if TINY and ratio == 4 else (300, 150) if TINY else (700, 300) if ratio == 4 else (600, 300)
    first = torch.randint(1, longest[0], (bs,), generator=g).tolist()
    second = [int(n) * bool(r % 3) for r, n in enumerate(torch.randint(1, longest[1], (bs,), generator=g))]
    first[0], second[0] = (10, 0) if ratio == 4 else (300, 83)
    decodes = 4 if ratio == 4 else 2
    return [("extend", first), ("extend", second)] + [("decode", [1] * bs)] * decodes


def check_backend_prefill_compressor(name: str, pool, indexer: bool, bs: int, g, ratio: int = 4) -> None:
    """forward_unified on extend steps (SGLang's CompressorPrefillPlan) then decode steps, C4
    (attention or indexer rows) or C128: our compressor against the reference chain on each
    request's whole raw sequence, and against SGLang's own forward_unified (JIT compress_forward
    with the prefill plan + compress_norm_rope_store) on the same steps where it builds: the
    state rings equal, the rows within twice the bound."""
    import sglang_cases as C
    from bounds import assert_indexer_pools_close, assert_kv_pools_close
    close = assert_indexer_pools_close if indexer else assert_kv_pools_close
    seed = int(torch.randint(0, 1 << 30, (1,), generator=g))
    steps = prefill_steps(ratio, bs, seed)
    what = "indexer" if indexer else f"C{ratio} attention"
    case = C.prefill_decode_case(pool, torch.Generator().manual_seed(seed), indexer, ratio, steps, device=DEV)
    label = (f"backend {what} compressor, extend + decode ({name}, {bs} requests, "
             f"{sum(steps[0][1]) + sum(steps[1][1])} prompt tokens, {len(case['dest'])} blocks)")
    try:
        outside = torch.ones(case["state"].shape[0], dtype=torch.bool)
        outside[case["ring"]] = False
        assert torch.equal(case["state"][outside], case["before"][outside]), "state outside the rings"
        close(case["pool"], case["ref_pool"], case["dest"], case["bound"], "rows")
        record(f"{label} vs reference", "PASS", bound="pre-rounding bound + one format step")
    except AssertionError as e:
        record(f"{label} vs reference", "FAIL", error=str(e)[:300])
    if DEV != "cuda":
        record(f"{label} vs SGLang's JIT prefill compressor", "SKIP", reason="no GPU")
        return
    try:
        theirs = C.prefill_decode_case(pool, torch.Generator().manual_seed(seed), indexer, ratio, steps,
                                       device=DEV, sglang_kernels=True)
    except Exception as e:
        record(f"{label} vs SGLang's JIT prefill compressor", "SKIP", reason=one_line(e))
        return
    try:
        assert torch.equal(case["state"], theirs["state"]), "state ring"
        close(case["pool"], theirs["pool"], case["dest"], 2 * case["bound"], "rows")
        record(f"{label} vs SGLang's JIT prefill compressor", "PASS",
               bound="2 x pre-rounding bound + one format step")
    except AssertionError as e:
        record(f"{label} vs SGLang's JIT prefill compressor", "FAIL", error=str(e)[:300])


def check_backend_online_compressor(name: str, bs: int, g) -> None:
    """Online C128 (SGLANG_OPT_USE_ONLINE_COMPRESS) over extend + decode steps on SGLang's pool
    with its online state: ours against the chain on the raw sequence, and against SGLang's
    forward_unified (its JIT online compressor) on the same steps where it builds: rows within
    twice the bound (the states hold the same running softmax in differently rounded forms,
    so they are not compared byte for byte; the largest difference is printed)."""
    import sglang_cases as C
    from bounds import assert_kv_pools_close
    os.environ["SGLANG_OPT_USE_ONLINE_COMPRESS"] = "1"
    try:
        seed = int(torch.randint(0, 1 << 30, (1,), generator=g))
        steps = prefill_steps(128, bs, seed)
        pool = lambda: C.dsv4_pool(DEV, online=True) if TINY else C.dsv4_pool(
            DEV, swa_tokens=64 * 256, full_tokens=256 * 1024, c128_pages=2048, state_slots=1024, online=True)
        case = C.prefill_decode_case(pool(), torch.Generator().manual_seed(seed), False, 128, steps,
                                     device=DEV, online=True)
        label = f"backend online C128 compressor, extend + decode ({name}, {bs} requests, {len(case['dest'])} blocks)"
        try:
            outside = torch.ones(case["state"].shape[0], dtype=torch.bool)
            outside[case["ring"]] = False
            assert torch.equal(case["state"][outside], case["before"][outside]), "state outside the rows"
            assert_kv_pools_close(case["pool"], case["ref_pool"], case["dest"], case["bound"], "rows")
            record(f"{label} vs reference", "PASS", bound="pre-rounding bound (+ state conversions) + one format step")
        except AssertionError as e:
            record(f"{label} vs reference", "FAIL", error=str(e)[:300])
        if DEV != "cuda":
            record(f"{label} vs SGLang's JIT online compressor", "SKIP", reason="no GPU")
            return
        try:
            theirs = C.prefill_decode_case(pool(), torch.Generator().manual_seed(seed), False, 128, steps,
                                           device=DEV, sglang_kernels=True, online=True)
        except Exception as e:
            record(f"{label} vs SGLang's JIT online compressor", "SKIP", reason=one_line(e))
            return
        state_diff = float((case["state"][case["ring"]] - theirs["state"][case["ring"]]).abs().max())
        try:
            assert_kv_pools_close(case["pool"], theirs["pool"], case["dest"], 2 * case["bound"], "rows")
            record(f"{label} vs SGLang's JIT online compressor", "PASS", state_max_diff=f"{state_diff:.3g}",
                   bound="2 x pre-rounding bound + one format step")
        except AssertionError as e:
            record(f"{label} vs SGLang's JIT online compressor", "FAIL", error=str(e)[:300],
                   state_max_diff=f"{state_diff:.3g}")
    finally:
        os.environ.pop("SGLANG_OPT_USE_ONLINE_COMPRESS", None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="small shapes (a CPU dry run under the interpreter)")
    args = ap.parse_args()
    global TINY
    TINY = args.tiny
    t0 = time.time()
    try:
        imports = import_sglang()
    except Exception as e:
        record("install", "FAIL", error=one_line(e), trace=traceback.format_exc(limit=6)[-1200:])
        return finish(args, t0)
    import dsv4_backend.sglang_adapter as A
    import sglang
    A.register()
    device = (f"{torch.cuda.get_device_name()} sm{torch.cuda.get_device_capability()}"
              if DEV == "cuda" else "cpu (Triton interpreter)")
    record("install", "PASS", sglang=sglang.__version__, torch=torch.__version__, device=device,
           sglang_cuda_branch=imports["cuda_branch"], stand_ins=list(imports["stand_ins"]) or "none")
    for module, why in imports["kernel_modules"].items():
        if why != "ok":
            record(f"import {module}", "INFO", error=why)
    guarded("SGLang's pools", run_checks)  # a pool SGLang cannot build stops the rest, not the report
    return finish(args, t0)


def run_checks() -> None:
    g = torch.Generator().manual_seed(0)
    pools = sglang_pools(swa_tokens=2 * 256, full_tokens=1024) if TINY else \
        sglang_pools(swa_tokens=64 * 256, full_tokens=256 * 1024)
    guarded("sglang page bytes", check_pages, pools)
    guarded("store swa", check_store, "SGLang SWA pool", pools[0], 256, g)
    guarded("store c4", check_store, "SGLang C4 pool", pools[1], 64, g)
    guarded("backend store_cache", check_backend_store, pools, g)
    if TINY:
        guarded("decode tiny", check_decode, "h8 top-k 16", pools, 8, 16, 2, g)
    else:
        guarded("decode flash", check_decode, "Flash h64 top-k 512", pools, 64, 512, 32, g)
        guarded("decode pro", check_decode, "Pro h128 top-k 1024", pools, 128, 1024, 16, g)
    guarded("indexer", check_indexer, pools, g)
    import sglang_cases as C
    if TINY:
        dsv4 = C.dsv4_pool(DEV)
        for ratio in (0, 4, 128):
            guarded(f"backend attention {ratio}", check_backend_attention, "tiny", dsv4, ratio, 2, 16, 64, g)
        guarded("backend indexer", check_backend_indexer, "tiny", dsv4, 4, 4, 64, 2, g)
        for indexer in (False, True):
            guarded(f"backend compressor {indexer}", check_backend_compressor, "tiny", dsv4, indexer, 4, g)
        guarded("backend compressor C128", check_backend_compressor, "tiny", dsv4, False, 4, g, 128)
        for indexer in (False, True):
            guarded(f"backend prefill compressor {indexer}", check_backend_prefill_compressor, "tiny", dsv4,
                    indexer, 2, g)
        guarded("backend prefill compressor C128", check_backend_prefill_compressor, "tiny", dsv4, False, 2,
                g, 128)
        guarded("backend online compressor", check_backend_online_compressor, "tiny", 2, g)
    else:
        dsv4 = C.dsv4_pool(DEV, swa_tokens=64 * 256, full_tokens=256 * 1024, c128_pages=2048, state_slots=1024)
        for name, h, k in (("Flash h64 top-k 512", 64, 512), ("Pro h128 top-k 1024", 128, 1024)):
            for ratio, width in ((0, 0), (4, k), (128, 512)):
                guarded(f"backend attention {ratio} {name}", check_backend_attention, name, dsv4, ratio,
                        32, h, width, g)
            guarded(f"backend indexer {name}", check_backend_indexer, name, dsv4, 32, 64, k, 64, g)
        for indexer in (False, True):
            guarded(f"backend compressor {indexer}", check_backend_compressor, "Flash / Pro d", dsv4,
                    indexer, 64, g)
        # C128 states: one 128-slot page a request (dsv4_pool has pages for 4 after page 0)
        guarded("backend compressor C128", check_backend_compressor, "Flash / Pro d", dsv4, False, 4, g, 128)
        for indexer in (False, True):
            guarded(f"backend prefill compressor {indexer}", check_backend_prefill_compressor, "Flash / Pro d",
                    dsv4, indexer, 16, g)
        # C128 rings: pages 1..3 of the 4 state pages after page 0
        guarded("backend prefill compressor C128", check_backend_prefill_compressor, "Flash / Pro d", dsv4,
                False, 3, g, 128)
        guarded("backend online compressor", check_backend_online_compressor, "Flash / Pro d", 3, g)


def finish(args, t0: float) -> int:
    """Print what ran: the checks, SGLang's kernels compared and not, the stand-ins' names."""
    import sglang_stubs
    ran, not_run = sglang_kernel_summary()
    for kernel, statuses in ran.items():
        record(f"ran: {kernel}", "INFO", checks=len(statuses), failed=statuses.count("FAIL"))
    for kernel, why in not_run.items():
        record(f"did not run: {kernel}", "INFO", reason=why)
    for package, use in sglang_stubs.report().items():
        record(f"stand-in {package}", "INFO", names_imported_by_sglang=len(use["handed_out"]),
               called=use["called"] or "none")
        CHECKS[-1]["handed_out"] = use["handed_out"]
    failed = [c["name"] for c in CHECKS if c["status"] == "FAIL"]
    passed = sum(c["status"] == "PASS" for c in CHECKS)
    skipped = sum(c["status"] == "SKIP" for c in CHECKS)
    print(f"checks: {passed} passed, {len(failed)} failed, {skipped} skipped ({time.time() - t0:.0f} s)", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_sglang_check.json").write_text(json.dumps(CHECKS, indent=1))
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
