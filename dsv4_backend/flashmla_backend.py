"""FlashMLA as the sparse-attention kernel on Hopper / Blackwell; the Triton kernels elsewhere.

``FlashMLADSV4Backend`` (registered as ``"flashmla"``) is the Triton backend with one call
swapped: each layer's attention over its window and extra rows goes through FlashMLA's
``flash_mla_with_kvcache`` (package ``sgl-flash-mla``, module ``flash_mla``) instead of our
``sparse_decode``. Everything else (the KV store, compression, the indexer's top-k, the static
decode buffers of the CUDA graphs) is the Triton backend's, so the pools' bytes are the same.

How our pools meet FlashMLA's V4 ("MODEL1") cache format, as its interface and asserts state:

- a cache is ``[num_blocks, page_block_size, 1, 584]`` with ``stride(1) == stride(2) == 584``
  (the asserts' "each page block must be contiguous") and any ``stride(0)``; the kernel finds a
  row's 576-byte nope|rope part at ``block * stride(0) + row * 576`` and its 8 scale bytes at
  ``block * stride(0) + page_block_size * 576 + row * 8``, which is memory/layout.py's page. So
  a pool ``[pages, page_bytes]`` is viewed ``pool[:, :P * 584].view(pages, P, 1, 584)``
  (:func:`flashmla_cache`): SWA pages as blocks of 128, C4 / C128 pages as blocks of 64. The
  view's shape is FlashMLA's convention, not a row's bytes (its ``[b, r, 0, 576:]`` is the next
  row's part); no byte is copied or moved.
- the sm100 kernels step through a block in 576-byte TMA rows and assert ``stride(0) % 576 ==
  0``; 64 * 584 and 128 * 584 are not multiples of 576, so this backend needs pools built with
  ``DSV4KVPools(..., page_align=FLASHMLA_PAGE_ALIGN)`` (the Engine does this when it picks
  FlashMLA) and refuses other pools by name. The sm90 kernel has no such assert.
- indices are ``block * page_block_size + row``: our SWA slots (page * 128 + row) and C4 / C128
  rows (page * 64 + row) as they are; only exactly -1 marks a missing key (no bound check).
- the index lists' widths must be multiples of the kernels' key blocks (the asserts
  ``topk % B_TOPK == 0`` / ``topk % TOPK_BLOCK_SIZE == 0``), so they are -1 padded to a
  multiple of ``INDEX_ALIGN``; heads are zero padded to 64 or 128 (the only counts it runs).
- the format is the legacy side's ``V4`` (the current kernels read only V4.1), so every call
  passes ``use_legacy=True, kv_format="V4"``; the sink is ``attn_sink`` (fp32 ``[h]``).

Scheduling metadata: one ``FlashMLASchedMeta`` per layer kind (SWA-only, CSA, HCA) and step.
The first layer of a kind fills it inside its own call (FlashMLA computes the split plan on a
fresh object), the other layers of that kind reuse it; a new step (a new metadata, or a static
decode step being warmed up, captured or run) starts with fresh objects, so a captured CUDA
graph contains the scheduler kernel and recomputes the plan on every replay. Its contract is
that the index shapes and the length values stay the same across reuses: CSA therefore passes
no ``extra_topk_length`` (the top-k lists differ per layer, their -1 entries are skipped), HCA
passes the per-step visible row count, which every HCA layer of the step shares.

Prefill chunks are decoded as independent query rows (``b = T``, ``s_q = 1``), as the Triton
backend does. ``flash_mla_sparse_fwd`` (FlashMLA's prefill kernel: bf16 keys ``[s_kv, 1, 512]``,
one index list per query row) is wired as :func:`flashmla_prefill_attention`: the chunk's
distinct keys are dequantised once into a bf16 workspace and the lists re-pointed at it. It is
off: on an H200 it took 11.4x the decode kernel's time for a 2048-row Flash CSA chunk
(docs/PERF.md). ``DSV4_FLASHMLA_PREFILL_ROWS=N`` sends chunks of at least N query rows (outside
graph capture) through it; bench/gpu_flashmla_check.py checks and times both.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F

from memory.layout import KV_ROW_BYTES, pool_page_size, read_kv_rows

from .backend import ForwardMetadata, register_attention_backend
from .config import DSV4Config
from .triton_backend import StaticDecode, TritonDSV4Backend, _StepPlan

ATTENTION_KERNELS = ("auto", "flashmla", "triton")
FLASHMLA_PAGE_ALIGN = 576   # the sm100 kernels' TMA row: a page's stride must be a multiple
INDEX_ALIGN = 128           # index-list widths: a multiple of every kernel's key block (64 or 128)
FLASHMLA_HEADS = (64, 128)
_KV_POOLS = ("swa_kv", "c4_kv", "c128_kv")


def flashmla_unavailable(device: str | torch.device, num_heads: Optional[int] = None) -> Optional[str]:
    """None when FlashMLA can run this model's attention on ``device``, else why not (importing
    ``flash_mla`` only on a CUDA device of compute capability 9.x or 10.x)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"FlashMLA needs a CUDA device, not {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"FlashMLA's V4-format kernels are built for sm90 / sm100, this GPU is sm{major}{minor}"
    if num_heads is not None and num_heads > max(FLASHMLA_HEADS):
        return f"FlashMLA runs at most {max(FLASHMLA_HEADS)} query heads, the model has {num_heads}"
    try:
        fm = importlib.import_module("flash_mla")
    except Exception as e:  # noqa: BLE001 (an ImportError, or the extension failing to load)
        return (f"flash_mla does not import ({type(e).__name__}: {e}); install it with "
                f"`pip install --no-deps sgl-flash-mla==1.0.0` (docs/kernels.md)")
    if not fm.has_legacy():
        return "this flash_mla build has no legacy kernels (sm90 and the V4 cache format)"
    return None


def resolve_attention_kernel(choice: str, device: str | torch.device, dtype: torch.dtype,
                             num_heads: Optional[int] = None) -> tuple[str, str]:
    """``(kernel, why)`` for ``--attention-kernel`` ``choice``: ``"flashmla"`` or ``"triton"``
    for the GPU backends, ``"torch"`` where the runner uses the PyTorch path (the CPU without
    the interpreter's kernels, float64). ``auto`` is FlashMLA where it can run, else Triton;
    asking for ``flashmla`` where it cannot run raises ValueError saying why."""
    if choice not in ATTENTION_KERNELS:
        raise ValueError(f"attention_kernel must be one of {list(ATTENTION_KERNELS)}, got {choice!r}")
    device = torch.device(device)
    gpu = device.type == "cuda" and dtype != torch.float64
    why_not = flashmla_unavailable(device, num_heads) if gpu and choice != "triton" else None
    if choice == "flashmla":
        if not gpu:
            raise ValueError(f"attention_kernel='flashmla' needs a CUDA device and a float32 / bfloat16 "
                             f"model, got {device.type} {dtype}")
        if why_not is not None:
            raise ValueError(f"attention_kernel='flashmla': {why_not}")
        return "flashmla", "asked for"
    if not gpu:
        return "torch", f"{device.type} {dtype}: the PyTorch path"
    if choice == "triton":
        return "triton", "asked for"
    if why_not is None:
        return "flashmla", "auto: FlashMLA imports on this GPU"
    return "triton", f"auto: {why_not}"


def flashmla_cache(pool: torch.Tensor, what: str) -> torch.Tensor:
    """The ``[pages, P, 1, 584]`` view FlashMLA takes of an attention pool ``uint8 [pages,
    page_bytes]`` (same storage; ``stride(0)`` stays the page's bytes)."""
    P = pool_page_size(pool, KV_ROW_BYTES, what)
    return pool[:, :P * KV_ROW_BYTES].view(pool.shape[0], P, 1, KV_ROW_BYTES)


def pad_indices(idx: torch.Tensor, align: int = INDEX_ALIGN) -> torch.Tensor:
    """int32 ``[b, k]`` -> contiguous int32 ``[b, ceil(k / align) * align]``, -1 padded (at
    least one block: FlashMLA takes no empty list)."""
    k = idx.shape[1]
    width = max(align, -(-k // align) * align)
    idx = idx.to(torch.int32)
    if width == k:   # top-k 512 / 1024, the window's 128: no copy per layer
        return idx.contiguous()
    return F.pad(idx, (0, width - k), value=-1).contiguous()


def list_lengths(idx: torch.Tensor) -> torch.Tensor:
    """int32 ``[b]``: one past the last valid (>= 0) entry of each row of ``idx [b, k]`` (a
    device computation, so a captured graph recomputes it)."""
    if idx.shape[1] == 0:
        return torch.zeros(idx.shape[0], dtype=torch.int32, device=idx.device)
    col = torch.arange(1, idx.shape[1] + 1, device=idx.device, dtype=torch.int32)
    return torch.where(idx >= 0, col, 0).amax(dim=1).to(torch.int32)


def padded_heads(h: int) -> int:
    """The FlashMLA head count that holds ``h`` query heads."""
    for n in FLASHMLA_HEADS:
        if h <= n:
            return n
    raise ValueError(f"FlashMLA runs at most {max(FLASHMLA_HEADS)} query heads, got {h}")


def flashmla_sparse_attention(fm: Any, q: torch.Tensor, swa_cache: torch.Tensor, window: torch.Tensor,
                              extra_cache: Optional[torch.Tensor], extra_rows: Optional[torch.Tensor],
                              extra_lengths: Optional[torch.Tensor], attn_sink: torch.Tensor,
                              softmax_scale: float, sched: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``flash_mla_with_kvcache`` call in our terms: q bf16 ``[b, h, 512]``, window / extra_rows
    int32 ``[b, k]`` already padded (:func:`pad_indices`), caches from :func:`flashmla_cache`.
    Returns ``(out bf16 [b, h, 512], lse fp32 [b, h])``, lse without the sink, as ``sparse_decode``."""
    b, h, _ = q.shape
    hp = padded_heads(h)
    if hp != h:
        q = F.pad(q, (0, 0, 0, hp - h))
        attn_sink = F.pad(attn_sink, (0, hp - h))
    extra = {}
    if extra_rows is not None:
        extra = dict(extra_k_cache=extra_cache, extra_indices_in_kvcache=extra_rows.unsqueeze(1),
                     extra_topk_length=extra_lengths)
    out, lse = fm.flash_mla_with_kvcache(
        q.contiguous().unsqueeze(1), swa_cache, None, None, 512, sched, softmax_scale=softmax_scale,
        is_fp8_kvcache=True, indices=window.unsqueeze(1), attn_sink=attn_sink.float().contiguous(),
        use_legacy=True, kv_format="V4", **extra)
    return out[:, 0, :h], lse[:, :h, 0]


def prefill_workspace(swa_pool: torch.Tensor, window: torch.Tensor, extra_pool: Optional[torch.Tensor],
                      extra_rows: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv bf16 ``[n, 1, 512]``: each distinct key of the chunk dequantised once, indices int32
    ``[T, 1, w]``: the window then the extra list re-pointed at kv, -1 kept and padded)."""
    lists, parts, base = [], [], 0
    for pool, idx in ((swa_pool, window), (extra_pool, extra_rows)):
        if idx is None or idx.shape[1] == 0:
            continue
        idx = idx.long()
        uniq, inv = torch.unique(idx, return_inverse=True)
        parts.append(read_kv_rows(pool, uniq).to(torch.bfloat16))   # slot -1 reads as zeros, never indexed
        lists.append(torch.where(idx >= 0, inv + base, -1))
        base += uniq.numel()
    return torch.cat(parts).unsqueeze(1), pad_indices(torch.cat(lists, 1).to(torch.int32)).unsqueeze(1)


def flashmla_prefill_attention(fm: Any, q: torch.Tensor, swa_pool: torch.Tensor, window: torch.Tensor,
                               extra_pool: Optional[torch.Tensor], extra_rows: Optional[torch.Tensor],
                               attn_sink: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """``flash_mla_sparse_fwd`` over a chunk: q bf16 ``[T, h, 512]``, window int ``[T, W]`` SWA slots,
    extra_rows int ``[T, k]`` or None (-1 = none). The distinct keys are dequantised into a bf16
    workspace ``[n, 1, 512]`` (exact: every key value is a bf16 number), the lists re-pointed at
    it and -1 padded to a multiple of ``INDEX_ALIGN``. Returns out bf16 ``[T, h, 512]``. Host
    syncs (``torch.unique``, the slot checks): eager prefill only."""
    T, h, _ = q.shape
    hp = padded_heads(h)
    kv, indices = prefill_workspace(swa_pool, window, extra_pool, extra_rows)
    if hp != h:
        q = F.pad(q, (0, 0, 0, hp - h))
        attn_sink = F.pad(attn_sink, (0, hp - h))
    out = fm.flash_mla_sparse_fwd(q.contiguous(), kv, indices, softmax_scale, d_v=512,
                                  attn_sink=attn_sink.float().contiguous(), use_legacy=True,
                                  return_log2_lse=False)[0]
    return out[:, :h]


def prefill_rows_threshold() -> Optional[int]:
    """``DSV4_FLASHMLA_PREFILL_ROWS``: the smallest chunk (query rows) sent to FlashMLA's prefill
    kernel; unset or 0: never."""
    n = int(os.environ.get("DSV4_FLASHMLA_PREFILL_ROWS", "0") or 0)
    return n if n > 0 else None


@register_attention_backend("flashmla")
class FlashMLADSV4Backend(TritonDSV4Backend):
    """DSV4 attention with FlashMLA's sparse decode kernel (CUDA sm90 / sm100, ``flash_mla``
    installed, pools built with ``page_align=FLASHMLA_PAGE_ALIGN``)."""

    def __init__(self, cfg: DSV4Config, pools: Any, tables: Any, dtype: torch.dtype = torch.float32,
                 dense: bool = False):
        device = getattr(pools, "device", torch.device("cpu"))
        why_not = flashmla_unavailable(device, cfg.num_attention_heads)
        if why_not is not None:
            raise ValueError(f"the flashmla backend cannot run: {why_not}")
        super().__init__(cfg, pools, tables, dtype=dtype, dense=dense)
        for kind in _KV_POOLS:
            for layer_id, pool in getattr(pools, kind).items():
                if pool.stride(0) % FLASHMLA_PAGE_ALIGN:
                    raise ValueError(f"{kind}[{layer_id}] pages are {pool.stride(0)} bytes apart; FlashMLA needs a "
                                     f"multiple of {FLASHMLA_PAGE_ALIGN}: build the pools with "
                                     f"DSV4KVPools(..., page_align={FLASHMLA_PAGE_ALIGN})")
        self.fm = importlib.import_module("flash_mla")
        self.prefill_rows = prefill_rows_threshold()
        self._step: dict[Any, Any] = {}   # per step: scheduling metadata and shared index tables

    # ---- per step ------------------------------------------------------------------------

    def _step_plan(self, meta: ForwardMetadata) -> _StepPlan:
        if self._plan_meta is not meta:
            self._step = {}
        return super()._step_plan(meta)

    def use_static_decode(self, st: StaticDecode) -> None:
        super().use_static_decode(st)
        self._step = {}

    def _shared(self, key: Any, make: Any) -> Any:
        if key not in self._step:
            self._step[key] = make()
        return self._step[key]

    # ---- per layer -----------------------------------------------------------------------

    def _sparse_attention(self, ratio: int, q: torch.Tensor, swa_pool: torch.Tensor, plan: _StepPlan,
                          extra_pool: Optional[torch.Tensor], extra_rows: Optional[torch.Tensor],
                          attn_sink: torch.Tensor) -> torch.Tensor:
        if q.shape[0] == 0:
            return torch.zeros(q.shape, dtype=torch.bfloat16, device=q.device)
        if (self.prefill_rows is not None and q.shape[0] >= self.prefill_rows
                and not torch.cuda.is_current_stream_capturing()):
            return flashmla_prefill_attention(self.fm, q, swa_pool, plan.window_slots, extra_pool, extra_rows,
                                              attn_sink, self.cfg.softmax_scale)
        window = self._shared("window", lambda: pad_indices(plan.window_slots))
        rows = lengths = extra_cache = None
        if extra_rows is not None and extra_rows.shape[1]:
            if ratio == 128:   # one list for every HCA layer of the step
                rows = self._shared("c128_rows", lambda: pad_indices(extra_rows))
                lengths = self._shared("c128_len", lambda: list_lengths(rows))
            else:
                rows = pad_indices(extra_rows)
            extra_cache = flashmla_cache(extra_pool, "extra (C4/C128)")
        key = ("sched", ratio, window.shape[1], None if rows is None else rows.shape[1])
        sched = self._shared(key, lambda: self.fm.get_mla_metadata()[0])
        out, _ = flashmla_sparse_attention(self.fm, q, flashmla_cache(swa_pool, "SWA"), window, extra_cache, rows,
                                           lengths, attn_sink, self.cfg.softmax_scale, sched)
        return out
