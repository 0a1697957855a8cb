"""SGLang 0.5.23 plugin: our Triton DSV4 attention backend and pool configurator inside SGLang.

The only module that imports SGLang. SGLang calls ``register()`` through the entry point
``dsv4_triton`` of group ``sglang.srt.plugins`` (pyproject.toml) in the launcher before
argument parsing, in ``Engine.__init__`` and in every scheduler process. It:

1. registers ``TritonDSV4AttnBackend`` under the name ``dsv4_triton`` in SGLang's attention
   registry and adds the name to the ``--attention-backend`` choices;
2. keeps it selected for DeepSeek-V4 checkpoints: SGLang's model override for
   ``DeepseekV4ForCausalLM`` declares ``attention_backend="dsv4"``, which silently replaces
   the user's ``--attention-backend``. We add a predicate-keyed override provider (SGLang's own
   registry; predicate providers run after the per-architecture ones and the last writer
   wins) that declares ``dsv4_triton`` for all three backend fields when the user asked for it;
3. wraps ``create_memory_pool_configurator`` (``HookRegistry``, AROUND): when ``dsv4_triton``
   is the backend of a DeepSeek-V4 model, SGLang's ``DSV4PoolConfigurator`` is replaced by
   ``TritonDSV4PoolConfigurator``, which prices the pools with ``memory.sglang_sizing`` and
   returns SGLang's ``MemoryPoolConfig``. The pool classes stay SGLang's;
4. wraps SGLang's ``_create_flashmla_metadata`` (AROUND) so that, under ``dsv4_triton``, its
   metadata builds where ``flash_mla`` is not installed (the FlashMLA tile schedules are None).

What is ours inside SGLang: the KV store (``store_cache``), the sparse attention of every query
(``_forward_attention``: SWA window + C4 top-k / all visible C128 rows, with the sink) and the
C4 indexer's scores and top-k (``forward_c4_indexer``), the C4 and C128 compressors of decode
and extend steps (``forward_core_compressor`` / ``forward_indexer_compressor`` on a DecodePlan
or a PrefillPlan, the online C128 one included), all on
SGLang's pools, state rings and per-query lists; and the configurator. What stays SGLang's: scheduler,
radix cache, model code, weights, MoE, the DSV4 pools and their page layout, the backend's
metadata and CUDA-graph machinery (inherited), the online C128 compressor with MTP, the
indexer's query projection, and every mode ``serves_attention`` /
``serves_indexer`` / ``serves_compressor`` leaves to SGLang's kernels.

``torchvision``: SGLang imports it at module level in one multimodal helper only. When it is
not installed (a ``--no-deps`` install, as in our tests), ``_stub_torchvision()`` puts a module
in its place whose every attribute raises ImportError when used, after telling transformers it
is absent; an installed torchvision is never touched.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import math
import sys
import types
from typing import NamedTuple

logger = logging.getLogger(__name__)

BACKEND_NAME = "dsv4_triton"
DSV4_ARCH = "DeepseekV4ForCausalLM"
_CONFIGURATOR_TARGET = "sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator"
_FLASHMLA_SCHEDULE_TARGET = "sglang.srt.layers.attention.deepseek_v4_backend._create_flashmla_metadata"


class _MissingTorchvision:
    """Stands for any torchvision attribute; using it raises ImportError."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_MissingTorchvision":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _MissingTorchvision(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self._name} needs torchvision, which is not installed")


def _stub_torchvision() -> None:
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.utils import import_utils  # caches "absent" before the stub exists

    import_utils.is_torchvision_available()
    import_utils.is_torchvision_v2_available()

    def attr_of(module_name: str):
        def getattr_(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _MissingTorchvision(f"{module_name}.{attr}")
        return getattr_

    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__path__ = []
        mod.__getattr__ = attr_of(name)
        sys.modules[name] = mod


_stub_torchvision()

import torch  # noqa: E402

from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices  # noqa: E402
from sglang.srt.arg_groups.model_override_base import register_model_override_predicate  # noqa: E402
from sglang.srt.layers.attention.attention_registry import register_attention_backend  # noqa: E402
from sglang.srt.layers.attention.deepseek_v4_backend import (  # noqa: E402
    DeepseekV4AttnBackend, DSV4AttnMetadata,
)
from sglang.srt.model_executor.pool_configurator import (  # noqa: E402
    MemoryPoolConfig, MemoryPoolConfigurator,
)
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402

from memory.layout import KV_ROW_BYTES  # noqa: E402
from dsv4_backend.kernels.compressor import CompressEvents, compress, online_c128_update  # noqa: E402
from dsv4_backend.kernels.indexer import indexer_topk  # noqa: E402
from dsv4_backend.kernels.kv_store import finish_rows, kv_store_rows  # noqa: E402
from dsv4_backend.kernels.sparse_attention import sparse_decode  # noqa: E402
from dsv4_backend.model import hadamard_matrix  # noqa: E402
from memory.sglang_sizing import SGLangPoolInputs, SGLangPoolSizes, SGLangPoolSizing  # noqa: E402


# ---- the backend ----------------------------------------------------------------------------

# Scores of one indexer call are fp32 [rows, visible C4 rows]; longer prefills are scored in
# row chunks of at most this many bytes (decode batches are one chunk).
INDEXER_SCORE_BYTES = 1 << 30


def _fit_rows(x: torch.Tensor, rows: int, fill: int) -> torch.Tensor:
    """``x`` cut or padded (with ``fill``) to ``rows`` rows: SGLang's metadata may have more rows
    (CUDA-graph padding) or fewer (MLP-sync padding of q) than the layer's queries."""
    if x.shape[0] >= rows:
        return x[:rows]
    return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), fill)])


def _as_bytes(pool: torch.Tensor) -> torch.Tensor:
    """SGLang hands its page buffers out typed as its KV dtype (e4m3); our kernels take bytes."""
    return pool if pool.dtype == torch.uint8 else pool.view(torch.uint8)


def live_indices(indices: torch.Tensor, lengths: torch.Tensor, rows: int) -> torch.Tensor:
    """SGLang's (indices, topk_lengths) pair as our -1-masked slot list, int32 [rows, n].

    FlashMLA reads entry j of a query's list only when j < topk_length and the entry is not -1;
    SGLang clamps some lengths to 1 (``*_clamp1``) over a -1 entry, so both conditions count.
    Padded query rows get an empty list."""
    indices = _fit_rows(indices, rows, -1)
    lengths = _fit_rows(lengths, rows, 0)
    j = torch.arange(indices.shape[1], device=indices.device)
    return torch.where(j[None, :] < lengths[:, None], indices, -1).to(torch.int32)


def decode_plan_fields(plan_d: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """SGLang's compressor DecodePlan rows, uint8 [bs, 16] = {u32 seq_len, i32 write_loc,
    i32 read_page_0, i32 read_page_1} (``compress_v2.cuh``), as four int64 [bs] columns."""
    f = plan_d.contiguous().view(torch.int32).long()
    return f[:, 0], f[:, 1], f[:, 2], f[:, 3]


def c4_decode_events(plan_d: torch.Tensor, out_loc: torch.Tensor, freqs_cis: torch.Tensor) -> CompressEvents:
    """Our compression events of one C4 decode step, read from SGLang's DecodePlan.

    SGLang's C4 state is ``[slots, 4 * d]`` in pages of 4 slots. A request whose ``seq_len`` is
    a multiple of 4 closes a block: its candidates are the previous block's page
    (``read_page_0``, masked for the first block, seq_len <= 4) then its own
    (``read_page_1``); the row goes to ``out_loc`` (C4 / indexer row) with RoPE at the block's
    first position seq_len - 4. Other requests get destination -1 (skipped)."""
    seq_len, _, page0, page1 = decode_plan_fields(plan_d)
    n = seq_len.shape[0]
    j = torch.arange(4, device=plan_d.device)
    prev = torch.where(seq_len[:, None] > 4, page0[:, None] * 4 + j, -1)
    sources = torch.cat([prev, page1[:, None] * 4 + j], 1)
    dest = torch.where(seq_len % 4 == 0, _fit_rows(out_loc.long(), n, -1), -1)
    rot = freqs_cis[(seq_len - 4).clamp_min(0)]
    return CompressEvents(dest, sources, rot.real.float().contiguous(), rot.imag.float().contiguous())


def c128_decode_events(plan_d: torch.Tensor, out_loc: torch.Tensor, freqs_cis: torch.Tensor) -> CompressEvents:
    """Our compression events of one C128 decode step, read from SGLang's DecodePlan.

    SGLang's (not online) C128 state is ``[slots, 2 * d]`` (``[kv | score]``, our ``[C | Z]``)
    in pages of 128 slots, one page a block. A request whose ``seq_len`` is a multiple of 128
    closes its block: the candidates are the 128 slots of page ``read_page_1`` (the new token's
    row, written at ``write_loc`` first, is the last of them); the row goes to ``out_loc`` (C128
    row) with RoPE at the block's first position seq_len - 128. Others get destination -1."""
    seq_len, _, _, page = decode_plan_fields(plan_d)
    n = seq_len.shape[0]
    sources = page[:, None] * 128 + torch.arange(128, device=plan_d.device)
    dest = torch.where(seq_len % 128 == 0, _fit_rows(out_loc.long(), n, -1), -1)
    rot = freqs_cis[(seq_len - 128).clamp_min(0)]
    return CompressEvents(dest, sources, rot.real.float().contiguous(), rot.imag.float().contiguous())


def prefill_plan_fields(plan_c: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """SGLang's compressor CompressPlan rows, uint8 [n, 16] = {u32 seq_len, u16 ragged_id,
    u16 buffer_len, i32 read_page_0, i32 read_page_1} (``compress_v2.cuh``), as int64 [n]
    columns (seq_len, ragged_id, buffer_len, read_page_0, read_page_1, valid). Padding rows
    (``CompressPlan::invalid()``, seq_len 0xFFFFFFFF) have valid false and seq_len 0."""
    f = plan_c.contiguous().view(torch.int32).long()
    valid = f[:, 0] != -1
    return (torch.where(valid, f[:, 0], 0), f[:, 1] & 0xFFFF, (f[:, 1] >> 16) & 0xFFFF,
            f[:, 2], f[:, 3], valid)


def prefill_events(plan_c: torch.Tensor, out_loc: torch.Tensor, freqs_cis: torch.Tensor, ratio: int,
                   tokens: int, requests: int) -> tuple[CompressEvents, torch.Tensor]:
    """Our compression events of one extend step, read from SGLang's CompressPlan rows.

    An event closes the block ending at q token ``ragged_id`` (position seq_len - 1). Its K
    candidates (C4: 8, the previous block's 4 tokens then this block's; C128: the block's 128)
    are window positions w = 0..K-1, i.e. q rows ``ragged_id - (K - 1) + w``, except the first
    ``buffer_len`` of them, which were computed by an earlier step and are read from SGLang's
    state ring (C4: w < 4 from page ``read_page_0``, else page ``read_page_1`` slot w - 4;
    C128: page ``read_page_1`` slot w). C4's first block (seq_len <= 4) has no previous block.
    The row goes to ``out_loc[ragged_id]`` with RoPE at seq_len - ratio.

    Our kernels read every candidate from one buffer: the step's ``tokens`` [C | Z] rows, then
    K ring rows for each event that reads the ring. Only the first K - 1 tokens of a request's
    extend have ring candidates, so at most ``K // ratio`` events of each of the ``requests``
    do; they are found without a host sync (a top-k on ``buffer_len > 0``). Returns the events
    (sources index that buffer) and the ring slots to gather, int64 [m * K]."""
    seq_len, ragged, buffer_len, page0, page1, valid = prefill_plan_fields(plan_c)
    n, k = seq_len.shape[0], (8 if ratio == 4 else 128)
    w = torch.arange(k, device=plan_c.device)
    if ratio == 4:
        ring = torch.where(w < 4, page0[:, None] * 4 + w, page1[:, None] * 4 + w - 4)
    else:
        ring = page1[:, None] * 128 + w
    from_ring = w < buffer_len[:, None]
    m = min(n, (k // ratio) * requests)
    reads_ring = (valid & (buffer_len > 0)).float()
    order = torch.topk(reads_ring, m).indices if m else reads_ring.new_zeros(0, dtype=torch.long)
    ring_slots = ring[order].clamp_min(0).reshape(-1)
    at = torch.zeros(n, dtype=torch.long, device=plan_c.device)
    at[order] = torch.arange(m, device=plan_c.device)
    sources = torch.where(from_ring, tokens + at[:, None] * k + w, ragged[:, None] - (k - 1) + w)
    live = valid[:, None] & ((w >= 4) | (seq_len[:, None] > 4) if ratio == 4 else True)
    sources = torch.where(live, sources, -1)
    dest = torch.where(valid, out_loc.long()[ragged.clamp_max(out_loc.shape[0] - 1)], -1)
    rot = freqs_cis[(seq_len - ratio).clamp_min(0)]
    events = CompressEvents(dest, sources, rot.real.float().contiguous(), rot.imag.float().contiguous())
    return events, ring_slots


def write_plan_rows(state: torch.Tensor, plan_w: torch.Tensor, kv_score: torch.Tensor) -> None:
    """SGLang's WritePlan rows, uint8 [n, 8] = {u32 ragged_id, i32 write_loc}: q row
    ``ragged_id``'s [C | Z] goes to state slot ``write_loc`` (in the state's dtype), as SGLang's
    write kernel does. Padding rows (ragged_id 0xFFFFFFFF) trail the real ones; without a host
    sync they repeat the first row's write (the same value to the same slot), or, when every
    row is padding, write slot 0 with its own value."""
    if plan_w.shape[0] == 0:
        return
    f = plan_w.contiguous().view(torch.int32).long()
    ragged, loc = f[:, 0], f[:, 1]
    valid = ragged >= 0
    any_row = valid[:1]
    src = torch.where(valid, ragged, ragged[:1].clamp_min(0))
    dst = torch.where(valid, loc, torch.where(any_row, loc[:1], 0))
    rows = torch.where((valid | any_row)[:, None], kv_score[src].to(state.dtype), state[dst])
    state[dst] = rows


class OnlineSegments(NamedTuple):
    """Runs of consecutive q rows of one request inside one 128-token block, one online-C128
    update each (SGLang's online plans, ``c128_online_v2.cuh``)."""
    start: torch.Tensor  # int64 [S]: first q row
    count: torch.Tensor  # int64 [S]: rows (0 for a padding row)
    first: torch.Tensor  # int64 [S]: position of the first row
    load: torch.Tensor  # int64 [S]: state slot holding the running state before the run
    store: torch.Tensor  # int64 [S]: state slot the running state after the run goes to


def online_segments(plan) -> OnlineSegments:
    """SGLang's online C128 plan as segments. Decode (DecodePlan ``{seq_len, write_loc,
    read_page_0, -1}``): request i is q row i at position seq_len - 1, loading slot
    read_page_0 and storing slot write_loc. Prefill (plan_c: segments that close a block,
    plan_w: each request's trailing partial segment; both CompressPlan rows ``{seq_len,
    ragged_id, buffer_len, read_page_0, read_page_1}``): the segment's ``buffer_len`` rows end
    at q row ``ragged_id``, position seq_len - 1; it loads read_page_1 (read_page_0 when that
    is -1) and stores read_page_0."""
    if hasattr(plan, "plan_d"):
        seq_len, write_loc, page0, _ = decode_plan_fields(plan.plan_d)
        rows = torch.arange(seq_len.shape[0], device=seq_len.device)
        return OnlineSegments(rows, torch.ones_like(rows), seq_len - 1, page0, write_loc)
    seq_len, ragged, length, page0, page1, valid = prefill_plan_fields(
        torch.cat([plan.plan_c, plan.plan_w]))
    count = torch.where(valid, length, 0)
    return OnlineSegments((ragged - length + 1).clamp_min(0), count, seq_len - length,
                          torch.where(page1 >= 0, page1, page0), page0)


def online_c128_step(state: torch.Tensor, plan, kv_score: torch.Tensor, out_loc: torch.Tensor,
                     ape: torch.Tensor, norm, freqs_cis: torch.Tensor, pool: torch.Tensor) -> None:
    """SGLang's online C128 compression of one step on our kernels.

    SGLang's online state is one row a request, ``[slots, 3 * d]`` = [running max | running
    sum | running softmax-weighted mean of kv] (its buffer dtype); ours (``online_c128_update``)
    keeps the unnormalised accumulator, so each segment's state is read into a scratch row of
    our form (acc = mean * sum), folded with the segment's rows by our kernel (restarting at a
    block's first position, as SGLang's kernels ignore the state there), and the rows of the
    tokens that close a block (position % 128 == 127) are finished into the C128 pool at
    ``out_loc`` (per request on decode, per q token on extend) with RoPE at position - 127. The
    running state goes back to SGLang's form at ``store`` for segments that leave a block open
    (SGLang writes no state when a block closes). Nothing waits on the host: a segment that
    writes nothing repeats a writing one's write (the same value to the same slot), or writes
    slot 0 with its own value when none writes."""
    d = ape.shape[1]
    seg = online_segments(plan)
    n, s_count, dev = kv_score.shape[0], seg.start.shape[0], kv_score.device
    old = state[seg.load.clamp_min(0)].float().view(s_count, 3, d)
    scratch = torch.stack([old[:, 0], old[:, 1], old[:, 2] * old[:, 1]], 1).contiguous()
    # each q row's position: its segment's first position plus its offset in the segment
    rows = torch.arange(n, device=dev)
    at = torch.where(seg.count > 0, seg.start, n)  # padding segments: a spare row n
    begins = torch.full((n + 1,), -1, dtype=torch.long, device=dev).scatter_(0, at, at)
    index = torch.zeros(n + 1, dtype=torch.long, device=dev).scatter_(0, at, torch.arange(s_count, device=dev))
    begin = begins[:n].cummax(0).values  # the first row of the last segment starting at or before
    o = index[begin.clamp_min(0)]
    covered = (begin >= 0) & (rows < seg.start[o] + seg.count[o])
    positions = torch.where(covered, seg.first[o] + rows - seg.start[o], 0)
    pooled = online_c128_update(scratch, torch.arange(s_count, device=dev), seg.start, seg.count,
                                kv_score.float().contiguous(), positions, ape.float())
    closing = covered & (positions % 128 == 127)
    dest = torch.where(closing, out_loc.long()[rows.clamp_max(out_loc.shape[0] - 1)], -1)
    rot = freqs_cis[(positions - 127).clamp_min(0)]
    finish_rows(pool, dest, pooled, norm.weight, rot.real.float().contiguous(), rot.imag.float().contiguous(),
                norm.variance_epsilon, round_in=True, round_bf16=True)
    keep = (seg.count > 0) & ((seg.first + seg.count - 1) % 128 != 127)
    j = torch.argmax(keep.int())  # a writing segment (0 when none writes)
    any_kept = keep[j]
    new = torch.cat([scratch[:, 0], scratch[:, 1], scratch[:, 2] / scratch[:, 1]], 1)
    dst = torch.where(keep, seg.store, torch.where(any_kept, seg.store[j], 0))
    src = torch.where(keep, torch.arange(s_count, device=dev), j)
    state[dst] = torch.where((keep | any_kept)[:, None], new[src].to(state.dtype), state[dst])


class TritonDSV4AttnBackend(DeepseekV4AttnBackend):
    """SGLang's DSV4 backend running our Triton kernels on SGLang's pools.

    Ours: the KV store (``store_cache``), the sparse attention of every query token
    (``_forward_attention``: SWA window plus the C4 top-k or all visible C128 rows, with the
    sink), the C4 indexer's scores and top-k (``forward_c4_indexer``) and the C4 / C128
    compressors of decode and extend steps (``forward_unified``). Inherited: metadata,
    ``init_forward_metadata``, CUDA-graph state, compression slots and plans, the online C128
    compression with MTP, the indexer's query projection (RoPE, Hadamard, FP8). SGLang's pools
    are uint8 ``[pages, page_bytes]`` whose pages hold P rows in our order (all 576-byte nope|rope parts,
    then all 8-byte scale groups) padded to 576-byte blocks; our kernels read P and the page
    stride from the tensor, so slot ``page * P + row`` is the same slot SGLang's kernels use.

    Modes our kernels do not serve fall through to SGLang's methods (``serves_attention``,
    ``serves_indexer``, ``serves_compressor``): TRT-LLM attention, the fused-RoPE "mega"
    attention, the DSV4.1 request window and layouts, the FP4 indexer, HiSparse, the top-k
    capturer, uniform-FP8 / unified KV pools, online C128 with MTP.
    """

    def store_cache(self, layer_id: int, swa_k: torch.Tensor, forward_batch) -> None:
        # swa_k: [N, 512] finished rows (kv_norm + RoPE applied); swa_loc: [N] SWA slots
        swa_loc = self.get_swa_out_cache_loc(forward_batch)
        kv_store_rows(self.token_to_kv_pool.get_swa_raw_buffer(layer_id), swa_loc, swa_k)

    # -- sparse attention --

    def serves_attention(self, compress_ratio: int, cos_sin_cache) -> bool:
        core = getattr(self.forward_metadata, "core_attn_metadata", None)
        pool = self.token_to_kv_pool
        return (isinstance(core, DSV4AttnMetadata) and compress_ratio in (0, 4, 128)
                and not self.trtllm_attn and not self.is_dsv41 and cos_sin_cache is None
                and pool.request_window is None
                and pool.get_swa_key_bytes_per_token() == KV_ROW_BYTES)

    def _forward_attention(self, q, k, v, layer, forward_batch, compress_ratio,
                           save_kv_cache: bool = True, attn_sink=None, cos_sin_cache=None, **kw):
        if not self.serves_attention(compress_ratio, cos_sin_cache):
            return super()._forward_attention(q, k, v, layer, forward_batch, compress_ratio,
                                              save_kv_cache, attn_sink, cos_sin_cache, **kw)
        if self.mtp_enabled and forward_batch.forward_mode.is_idle():
            return q.new_empty((q.shape[0], q.shape[1], layer.v_head_dim))
        if k is not v:
            raise ValueError("DeepSeek-V4 attention shares k and v (one latent row)")
        if attn_sink is None:
            raise ValueError(f"{BACKEND_NAME}: attn_sink is required")
        if save_kv_cache:
            self.store_cache(layer.layer_id, k, forward_batch)
        return self.sparse_attention(q, layer.layer_id, compress_ratio, attn_sink)

    def sparse_attention(self, q: torch.Tensor, layer_id: int, compress_ratio: int,
                         attn_sink: torch.Tensor) -> torch.Tensor:
        """``sparse_decode`` over SGLang's per-query lists: q [T, H, 512] (or [T, 1, H, 512]) ->
        [T, H, 512]. Heads past ``attn_sink``'s (FlashMLA's head padding) come back 0."""
        core = self.forward_metadata.core_attn_metadata
        pool = self.token_to_kv_pool
        q = q.squeeze(1) if q.dim() == 4 else q
        T, H, _ = q.shape
        heads = attn_sink.shape[0]
        if heads > H:
            raise ValueError(f"attn_sink has {heads} heads, q {H}")
        window = live_indices(core.swa_page_indices, core.swa_topk_lengths, T)
        extra_pool = extra = None
        if compress_ratio != 0:
            extra_pool = _as_bytes(pool.get_extra_key_buffer(layer_id))
            extra = live_indices(core.sparse_page_indices(compress_ratio),
                                 core.sparse_topk_lengths(compress_ratio), T)
        out = (torch.zeros if heads < H else torch.empty)(T, H, 512, dtype=q.dtype, device=q.device)
        sparse_decode(q[:, :heads], _as_bytes(pool.get_swa_key_buffer_radix(layer_id)), window, extra_pool,
                      extra, attn_sink, self.softmax_scale, out=out[:, :heads])
        return out

    # -- the compressors of decode steps (C4 attention and indexer rows, C128 attention rows) --

    def serves_compressor(self, layer_id: int, compressor) -> bool:
        from sglang.kernels.ops.attention.dsv4 import CompressorDecodePlan, CompressorPrefillPlan
        from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
        from sglang.srt.layers.attention.dsv4.compressor_v2 import _use_online_compress
        from sglang.srt.layers.attention.dsv4.unified_kv_gate import is_unified_kv_triton
        pool = self.token_to_kv_pool
        plan = getattr(self.forward_metadata, f"c{compressor.ratio}_compress_metadata", None)
        if compressor.ratio not in (4, 128) or not isinstance(plan, (CompressorDecodePlan,
                                                                     CompressorPrefillPlan)):
            return False
        if compressor.ratio == 128 and (compressor.is_in_indexer
                                        or getattr(self, "online_c128_mtp", None) is not None):
            return False
        if _use_online_compress(compressor.ratio) and (compressor.get_state_pool(self).kv_score_buffer
                                                       .kv_score.shape[-1] != 3 * compressor.head_dim):
            return False
        if not compressor.ape_converted or pool.uniform_fp8 or is_unified_kv_triton():
            return False
        if compressor.is_in_indexer:
            return not self.enable_deepseek_v4_fp4_indexer
        kv_pool = pool.layer_mapping[layer_id].compress_kv_pool
        return (pool.get_extra_key_layout(layer_id) is KVLayout.V4
                and not hasattr(kv_pool, "translate_loc_to_hisparse_device"))

    def forward_unified(self, x, forward_batch, layer_id: int, compressor) -> None:
        """C4 and C128 compression of decode and extend steps (online C128 too): our compressor on
        SGLang's state and pools; online C128 with MTP, HiSparse, FP4 / unified layouts are SGLang's."""
        if forward_batch.forward_mode.is_idle():
            return
        if not self.serves_compressor(layer_id, compressor):
            return super().forward_unified(x, forward_batch, layer_id, compressor)
        kv_score = compressor.compute_kv_score(x, forward_batch)  # fp32 [tokens, 2 * coff * d] = [C | Z]
        self.compress_step(layer_id, compressor, kv_score, forward_batch.batch_size)

    forward_core_compressor = forward_unified
    forward_indexer_compressor = forward_unified

    def compress_step(self, layer_id: int, compressor, kv_score: torch.Tensor, requests: int) -> None:
        """One step's compression on SGLang's plan (``c{ratio}_compress_metadata``).

        Decode plan: each request's new [C | Z] goes to its ``write_loc`` (as SGLang's kernel
        does, every row), then the blocks this step closes are pooled from the ring. Prefill
        plan: the closed blocks are pooled from the step's rows and the ring rows computed by
        earlier steps (read before this step writes the ring, as SGLang's compress kernel runs
        before its write kernel), then the write plan's rows (the unfinished block, C4's
        overlap block) go to the ring for the following steps. Pooling, norm, RoPE, (Hadamard,)
        quantised store: C4 the fused kernel, C128 pool + finish, into the C4 / C128 pool or
        the indexer pool."""
        from sglang.kernels.ops.attention.dsv4 import CompressorDecodePlan
        pool = self.token_to_kv_pool
        ratio, d = compressor.ratio, compressor.head_dim
        from sglang.srt.layers.attention.dsv4.compressor_v2 import _use_online_compress
        plan = getattr(self.forward_metadata, f"c{ratio}_compress_metadata")
        state = compressor.get_state_pool(self).kv_score_buffer.kv_score  # [slots, 2 * coff * d]
        out_loc = getattr(self.forward_metadata.core_metadata, f"c{ratio}_out_loc")
        if _use_online_compress(ratio):  # state [slots, 3 * d]
            online_c128_step(state, plan, kv_score, out_loc, compressor.ape.view(128, d), compressor.norm,
                             compressor.freqs_cis, _as_bytes(pool.get_extra_key_buffer(layer_id)))
            return
        if isinstance(plan, CompressorDecodePlan):
            _, write_loc, _, _ = decode_plan_fields(plan.plan_d)
            state[write_loc] = kv_score.to(state.dtype)
            events = (c4_decode_events if ratio == 4 else c128_decode_events)(
                plan.plan_d, out_loc, compressor.freqs_cis)
            candidates = state
        else:
            events, ring_slots = prefill_events(plan.plan_c, out_loc, compressor.freqs_cis, ratio,
                                                kv_score.shape[0], requests)
            candidates = torch.cat([kv_score, state[ring_slots].to(kv_score.dtype)])
            write_plan_rows(state, plan.plan_w, kv_score)
        if ratio == 4:
            halves = compressor.ape.view(8, d)  # SGLang's loader stored ape as [ape[:, :d]; ape[:, d:]]
            ape = torch.cat([halves[:4], halves[4:]], 1)
        else:
            ape = compressor.ape.view(128, d)  # no overlap: SGLang stores the checkpoint's ape
        if compressor.is_in_indexer:
            target = pool.get_index_k_with_scale_buffer(layer_id)
            hadamard = hadamard_matrix(128, torch.float32, state.device)
        else:
            target, hadamard = pool.get_extra_key_buffer(layer_id), None
        compress(_as_bytes(target), events, candidates, ape, compressor.norm.weight, ratio,
                 eps=compressor.norm.variance_epsilon, hadamard=hadamard)

    # -- the C4 indexer --

    def serves_indexer(self, c4_indexer) -> bool:
        from sglang.srt.state_capturer.indexer_topk import get_global_indexer_capturer
        return (not c4_indexer.use_fp4_indexer and self.hisparse_coordinator is None
                and get_global_indexer_capturer() is None
                and not self.debug_use_external_c4_sparse_indices)

    def forward_c4_indexer(self, x, q_lora, c4_indexer, forward_batch, alt_streams=None,
                           enable_multi_stream: bool = False, q_lora_ready=None,
                           skip_compressor: bool = False, q_lora_quant=None) -> None:
        if not self.serves_indexer(c4_indexer):
            return super().forward_c4_indexer(x, q_lora, c4_indexer, forward_batch, alt_streams,
                                              enable_multi_stream, q_lora_ready, skip_compressor,
                                              q_lora_quant)
        if forward_batch.forward_mode.is_idle():
            return
        positions = self.forward_metadata.core_metadata.positions
        n = min(x.shape[0], q_lora.shape[0], positions.shape[0])
        if q_lora.shape[0] != n:
            q_lora, q_lora_quant = q_lora[:n], None
        x, positions = x[:n], positions[:n]
        if enable_multi_stream:
            q, weights = self._forward_prepare_multi_stream(
                x=x, q_lora=q_lora, c4_indexer=c4_indexer, positions=positions,
                forward_batch=forward_batch, alt_streams=alt_streams, q_lora_ready=q_lora_ready)
        else:
            if q_lora_ready is not None:
                raise ValueError("q_lora_ready is only used with enable_multi_stream")
            q, weights = self._forward_prepare_normal(
                x=x, q_lora=q_lora, c4_indexer=c4_indexer, positions=positions,
                forward_batch=forward_batch, skip_compressor=skip_compressor,
                q_lora_quant=q_lora_quant)
        self.select_c4_rows(q, weights.squeeze(2), c4_indexer.layer_id)

    def select_c4_rows(self, q: torch.Tensor, weights: torch.Tensor, layer_id: int) -> None:
        """Our indexer scores and top-k into SGLang's ``c4_sparse_page_indices`` (in place).

        q: FP8 [T, H, 128] RoPE'd, Hadamard-rotated queries; weights: fp32 [T, H] with the
        queries' scales folded in (SGLang's ``compute_q``). Rows of query t: list position j <
        ``compressed_seq_lens[t]`` is C4 row ``page_table[t, j // 64] * 64 + j % 64``. The
        ``index_topk`` best (all of them when fewer are visible) are written best first, -1
        after; SGLang's kernels list the same set (in position order when all fit)."""
        metadata = self.forward_metadata
        im, core = metadata.indexer_metadata, metadata.core_metadata
        out = core.c4_sparse_page_indices  # int32 [T', index_topk padded to 64]
        pool = _as_bytes(self.token_to_kv_pool.get_index_k_with_scale_buffer(layer_id))
        rows = min(q.shape[0], out.shape[0])
        table = _fit_rows(im.page_table, rows, 0)
        visible = _fit_rows(im.compressed_seq_lens.reshape(-1), rows, 0)
        k = self.index_topk
        step = max(1, INDEXER_SCORE_BYTES // (4 * max(1, table.shape[1] * im.compressed_page_size)))
        for s in range(0, rows, step):
            e = min(rows, s + step)
            top = indexer_topk(q[s:e], weights[s:e], pool, k, page_table=table[s:e],
                               num_visible=visible[s:e]).rows
            out[s:e, :k].copy_(top)
        out[:rows, k:].fill_(-1)


def create_backend(runner) -> TritonDSV4AttnBackend:
    return TritonDSV4AttnBackend(runner)


# ---- keeping the backend for DeepSeek-V4 ----------------------------------------------------

def keep_backend_for_dsv4(server_args, hf_config) -> dict:
    """Override provider: re-declare ``dsv4_triton`` after SGLang's DSV4 override forced "dsv4".

    Reads the user's raw fields (resolution never mutates them). Any of the three backend
    flags naming ``dsv4_triton`` selects it for both phases.
    """
    asked = (server_args.attention_backend, server_args.prefill_attention_backend,
             server_args.decode_attention_backend)
    if BACKEND_NAME not in asked:
        return {}
    return {"attention_backend": BACKEND_NAME, "prefill_attention_backend": BACKEND_NAME,
            "decode_attention_backend": BACKEND_NAME}


# ---- the configurator -----------------------------------------------------------------------

class TritonDSV4PoolConfigurator(MemoryPoolConfigurator):
    """Sizes SGLang's DSV4 pools with ``memory.sglang_sizing``; returns ``MemoryPoolConfig``.

    Built from the same inputs SGLang's ``DSV4PoolConfigurator`` reads: the model (this
    stage's compress ratios), the env flags, speculative decoding, HiSparse's
    host-to-device ratio, attention DP (requests per worker) and the SWA sizing mode (the
    operator's ``--swa-full-tokens-ratio``, else SGLang's request cap when chunked prefill is
    on). Modes our kernels do not serve are refused by name.
    """

    def __init__(self, kvc) -> None:
        from sglang.srt.environ import envs
        from sglang.srt.model_executor.pool_configurator import (
            DSV4_DEFAULT_SWA_FULL_TOKENS_RATIO, _get_dsv4_compress_state_dtype_sizes,
            _operator_swa_full_tokens_ratio,
        )
        from sglang.srt.runtime_context import (
            get_disagg, get_exec, get_memory, get_schedule, get_spec, max_speculative_num_draft_tokens,
        )

        cfg = kvc.model_config
        ratios = tuple(cfg.compress_ratios[kvc.layer_info.start_layer:kvc.layer_info.end_layer])
        if any(r in (1, 2) for r in ratios):
            raise ValueError(f"{BACKEND_NAME}: compress ratios 1/2 (DeepSeek-V4.1) are not supported")
        if get_exec().features.enable_encoder_swa_bounded_replay:
            raise ValueError(f"{BACKEND_NAME}: --enable-encoder-swa-bounded-replay is not supported")
        if get_disagg().disaggregation_mode == "decode":
            raise ValueError(f"{BACKEND_NAME}: --disaggregation-mode decode is not supported")
        self.page_size = kvc.page_size
        self.sliding_window_size = kvc.sliding_window_size
        schedule = get_schedule()
        if schedule.max_running_requests is None:
            raise ValueError(f"{BACKEND_NAME}: max_running_requests must be resolved (SGLang's DSV4 "
                             "defaults set 256)")
        requests = max(1, schedule.max_running_requests // kvc.attn_dp_size)
        speculative = get_spec().speculative_algorithm is not None
        operator_ratio = _operator_swa_full_tokens_ratio()
        self.inputs = SGLangPoolInputs(
            layer_ratios=ratios,
            sliding_window=kvc.sliding_window_size,
            max_running_requests=requests,
            state_bytes=_get_dsv4_compress_state_dtype_sizes()[0],
            swa_ratio=operator_ratio if operator_ratio is not None else DSV4_DEFAULT_SWA_FULL_TOKENS_RATIO,
            swa_cap_tokens=None if operator_ratio is not None else self._swa_cap(kvc, requests),
            speculative=speculative,
            draft_tokens=(max_speculative_num_draft_tokens() or 0),
            online_compress=bool(envs.SGLANG_OPT_USE_ONLINE_COMPRESS.get()),
            c4_shrink_factor=self._shrink(get_memory()),
            page=kvc.page_size,
        )
        self.sizing = SGLangPoolSizing(self.inputs)

    @staticmethod
    def _shrink(memory) -> int:
        if not memory.enable_hisparse:
            return 1
        from sglang.srt.mem_cache.sparsity import parse_hisparse_config
        return parse_hisparse_config().host_to_device_ratio

    @staticmethod
    def _swa_cap(kvc, requests: int) -> int | None:
        """SGLang's cap mode (scheduler policy): worst-case live SWA slots plus radix headroom."""
        from sglang.srt.model_executor.pool_configurator import compute_swa_request_cap
        from sglang.srt.runtime_context import get_disagg, get_memory, get_schedule

        schedule = get_schedule()
        chunk = schedule.chunked_prefill_size
        if get_disagg().disaggregation_mode != "decode" and (chunk is None or chunk <= 0):
            return None
        cap = compute_swa_request_cap(page_size=kvc.page_size, window=kvc.sliding_window_size,
                                      attn_dp_size=kvc.attn_dp_size)
        tails = schedule.swa_prefix_tails
        if tails is None:
            tails = 0 if get_memory().disable_radix_cache else 4 * requests
        headroom = tails * (kvc.sliding_window_size + kvc.page_size)
        return math.ceil((cap + headroom) / kvc.page_size) * kvc.page_size

    def _config(self, sizes: SGLangPoolSizes) -> MemoryPoolConfig:
        full = sizes.full_max_total_num_tokens
        return MemoryPoolConfig(
            max_total_num_tokens=full, full_max_total_num_tokens=full,
            swa_max_total_num_tokens=sizes.swa_max_total_num_tokens,
            c4_max_total_num_tokens=sizes.c4_max_total_num_tokens,
            c128_max_total_num_tokens=sizes.c128_max_total_num_tokens,
            c4_state_pool_size=sizes.c4_state_pool_size,
            c128_state_pool_size=0,  # request-scoped: set by finalize_with_max_running_requests
        )

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> MemoryPoolConfig:
        self._check_page(page_size)
        return self._config(self.sizing.sizes_for_budget(available_bytes))

    def calculate_pool_sizes_from_max_tokens(self, max_total_num_tokens: int,
                                             page_size: int) -> MemoryPoolConfig:
        self._check_page(page_size)
        return self._config(self.sizing.sizes_for_tokens(max_total_num_tokens))

    def finalize_with_max_running_requests(self, config: MemoryPoolConfig) -> MemoryPoolConfig:
        slots = config.max_running_requests + 1
        config.c128_state_pool_size = slots * self.sizing.c128_ring if self.inputs.count(128) else 0
        return config

    def _check_page(self, page_size: int) -> None:
        if page_size != self.inputs.page:
            raise ValueError(f"{BACKEND_NAME}: page_size {page_size} differs from the configured "
                             f"{self.inputs.page}")


def _uses_our_backend() -> bool:
    from sglang.srt.runtime_context import get_exec
    return get_exec().kernel.attention_backend == BACKEND_NAME


def create_configurator(original, kvc):
    """AROUND hook on ``create_memory_pool_configurator``: ours for DSV4 under dsv4_triton."""
    from sglang.srt.configs.model_config import is_deepseek_v4

    if is_deepseek_v4(kvc.model_config.hf_config) and kvc.is_hybrid_swa and _uses_our_backend():
        return TritonDSV4PoolConfigurator(kvc)
    return original(kvc)


def flashmla_schedule(original):
    """AROUND hook on SGLang's ``_create_flashmla_metadata``: SGLang's metadata builds a FlashMLA
    tile schedule per ratio (``init_flashmla_related``), which imports ``flash_mla``. Under
    ``dsv4_triton`` only the modes that fall through to SGLang's kernels read it, so where
    ``flash_mla`` is not installed the schedule is None instead of an ImportError."""
    try:
        return original()
    except ImportError:
        if not _uses_our_backend():
            raise
        return None


# ---- the entry point ------------------------------------------------------------------------

_registered = False


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    register_attention_backend(BACKEND_NAME)(create_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    register_model_override_predicate(lambda arch: arch == DSV4_ARCH)(keep_backend_for_dsv4)
    HookRegistry.register(_CONFIGURATOR_TARGET, create_configurator, HookType.AROUND)
    HookRegistry.register(_FLASHMLA_SCHEDULE_TARGET, flashmla_schedule, HookType.AROUND)
    logger.info("registered attention backend %s and its DSV4 pool configurator", BACKEND_NAME)


__all__ = ["BACKEND_NAME", "TritonDSV4AttnBackend", "TritonDSV4PoolConfigurator",
           "create_configurator", "keep_backend_for_dsv4", "register"]
