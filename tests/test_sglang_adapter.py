"""The SGLang 0.5.23 plugin (dsv4_backend/sglang_adapter.py) against SGLang itself, on the CPU.

Needs ``sglang==0.5.23`` installed ``--no-deps`` with the packages of tests/sglang-requirements.txt
(``make test-sglang``); skipped where SGLang is absent. SGLang is imported once per module (its
import takes ~15 s on two cores). Everything runs SGLang's real code: the entry-point discovery,
the argument resolution of a DeepSeek-V4 config, SGLang's own ``DSV4PoolConfigurator``, SGLang's
pool classes built on the CPU. Our kernels run under the Triton interpreter at tiny shapes.
"""

import itertools
import json
import sys
from types import SimpleNamespace as NS

import pytest
import torch

pytest.importorskip("sglang", reason="sglang==0.5.23 is not installed (make test-sglang)")

import dsv4_backend.sglang_adapter as A  # noqa: E402  (stubs torchvision before SGLang loads)
import sglang.srt.mem_cache.deepseek_v4_memory_pool as sgl_pool  # noqa: E402
from sglang.srt.mem_cache.deepseek_v4_memory_pool import (  # noqa: E402
    DeepSeekV4IndexerPool, DeepSeekV4SingleKVPool,
)
from sglang.srt.model_executor import pool_configurator as sgl_cfg  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402

import sglang_cases as C  # noqa: E402
from bounds import assert_within, attention_bound, indexer_score_bound  # noqa: E402
from conftest import ROOT, TESTDATA  # noqa: E402
from dsv4_backend.kernels import reference as R  # noqa: E402
from dsv4_backend.kernels.indexer import indexer_scores  # noqa: E402
from dsv4_backend.kernels.kv_store import kv_store_rows  # noqa: E402
from dsv4_backend.kernels.sparse_attention import DecodeAttentionConfig, sparse_decode  # noqa: E402
from memory.layout import (  # noqa: E402
    pack_kv_page, read_indexer_rows, read_kv_rows, write_indexer_rows, write_kv_rows,
)  # noqa: E402
from memory.quant import indexer_fake_quant  # noqa: E402
from memory.sglang_sizing import SGLangPoolInputs, SGLangPoolSizing, attention_page_bytes  # noqa: E402

FLASH = json.loads((TESTDATA / "configs" / "deepseek-v4-flash.config.json").read_text())
PRO = json.loads((TESTDATA / "configs" / "deepseek-v4-pro.config.json").read_text())


@pytest.fixture(scope="module", autouse=True)
def plugin():
    """Run the plugin as SGLang's loader would, then apply the hooks it registered."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    A.register()
    HookRegistry.apply_hooks()


# ---- the entry point -------------------------------------------------------------------------

def _entry_points_from_pyproject() -> str:
    import tomllib
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    return "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in table.items()) + "\n"
                   for group, table in eps.items())


def test_entry_point_is_discovered_and_registers_the_backend(tmp_path, monkeypatch):
    """SGLang's own loader finds the entry point pyproject.toml declares and runs it."""
    import sglang.srt.plugins as plugins
    dist = tmp_path / "dsv4_plugin_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dsv4-plugin-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(_entry_points_from_pyproject())
    monkeypatch.syspath_prepend(str(tmp_path))
    found = plugins.load_plugins_by_group(plugins.GENERAL_PLUGINS_GROUP)
    assert found[A.BACKEND_NAME][0] is A.register
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    plugins.load_plugins()
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    assert ATTENTION_BACKENDS[A.BACKEND_NAME] is A.create_backend
    assert ATTENTION_BACKEND_CHOICES.count(A.BACKEND_NAME) == 1
    assert issubclass(A.TritonDSV4AttnBackend, sys.modules[
        "sglang.srt.layers.attention.deepseek_v4_backend"].DeepseekV4AttnBackend)


# ---- argument resolution ---------------------------------------------------------------------

def _resolve(tmp_path, *argv):
    from sglang.srt.arg_groups.model_override_base import attention_backends_of, resolved_view
    from sglang.srt.server_args import prepare_server_args
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(FLASH))
    args = prepare_server_args(["--model-path", str(model), "--device", "cpu", "--skip-tokenizer-init", *argv])
    args.resolve_once()
    view = resolved_view(args)
    return attention_backends_of(view), view


@pytest.mark.parametrize("flags", [
    ["--attention-backend", "dsv4_triton"],
    ["--prefill-attention-backend", "dsv4_triton", "--decode-attention-backend", "dsv4_triton"],
])
def test_resolution_keeps_our_backend_for_dsv4(tmp_path, flags):
    """Regression: SGLang's DSV4 override declares "dsv4"; our provider re-declares ours."""
    backends, view = _resolve(tmp_path, *flags)
    assert backends == ("dsv4_triton", "dsv4_triton")
    assert view.attention_backend == "dsv4_triton"
    assert view.page_size == 256  # the rest of SGLang's DSV4 defaults still apply
    assert view.max_running_requests == 256


def test_resolution_of_another_backend_is_still_forced_to_dsv4(tmp_path):
    """The behaviour our provider works around (and leaves alone for other backends)."""
    backends, _ = _resolve(tmp_path, "--attention-backend", "triton")
    assert backends == ("dsv4", "dsv4")


# ---- the configurator ------------------------------------------------------------------------

def _kvc(config, page=256, dp=1):
    ratios = config["compress_ratios"]
    L = config["num_hidden_layers"]
    mc = NS(qk_nope_head_dim=448, qk_rope_head_dim=64, index_head_dim=config["index_head_dim"],
            context_len=config["max_position_embeddings"], compress_ratios=ratios,
            hf_config=NS(kv_source_layer_ids=[], architectures=config["architectures"]),
            window_size=config["sliding_window"])
    return NS(kv_cache_dtype_str="fp8_e4m3", model_config=mc, is_hybrid_swa=True,
              layer_info=NS(start_layer=0, end_layer=L), pp_size=1,
              sliding_window_size=config["sliding_window"], page_size=page, attn_dp_size=dp,
              spec_algorithm=NS(is_dspark=lambda: False, is_none=lambda: True, is_eagle=lambda: False))


def _server_fields(R, dp, explicit_ratio, spec, hisparse, chunk=8192):
    fields = dict(page_size=256, max_running_requests=R, chunked_prefill_size=chunk, tp_size=2 * dp,
                  attn_dp_size=dp)
    if explicit_ratio is not None:
        fields.update(swa_full_tokens_ratio=explicit_ratio, _swa_full_tokens_ratio_explicitly_set=True)
    if spec:
        fields.update(speculative_algorithm="EAGLE", speculative_num_draft_tokens=2,
                      speculative_num_steps=1, speculative_eagle_topk=1)
    if hisparse:
        fields.update(enable_hisparse=True, hisparse_config=json.dumps({"host_to_device_ratio": hisparse}))
    return fields


@pytest.fixture
def env_flags(monkeypatch):
    def set_flags(bf16: bool, online: bool):
        monkeypatch.setenv("SGLANG_DSV4_COMPRESS_STATE_DTYPE", "bf16" if bf16 else "float32")
        monkeypatch.setenv("SGLANG_OPT_USE_ONLINE_COMPRESS", "1" if online else "0")
        # SGLang reads this flag once at import for its ring size; a launch sets it before.
        monkeypatch.setattr(sgl_pool, "ONLINE_C128", online)
    return set_flags


def _both(config, fields, budget, dp=1):
    """SGLang's and our configs for a budget, and for half its tokens; None where both refuse."""
    with get_context().override_server_args(**fields):
        kvc = _kvc(config, dp=dp)
        theirs, ours = sgl_cfg.DSV4PoolConfigurator(kvc), A.TritonDSV4PoolConfigurator(kvc)
        try:
            a = theirs.calculate_pool_sizes(budget, 256)
        except (RuntimeError, ValueError) as refusal:
            with pytest.raises((RuntimeError, ValueError)):
                ours.calculate_pool_sizes(budget, 256)
            return None, None, theirs, ours, refusal
        b = ours.calculate_pool_sizes(budget, 256)
        for c in (a, b):
            c.max_running_requests = fields["max_running_requests"] // dp
        a, b = theirs.finalize_with_max_running_requests(a), ours.finalize_with_max_running_requests(b)
        t = theirs.calculate_pool_sizes_from_max_tokens(a.full_max_total_num_tokens // 2, 256)
        o = ours.calculate_pool_sizes_from_max_tokens(a.full_max_total_num_tokens // 2, 256)
    return (a, t), (b, o), theirs, ours, None


GRID = [c for c in itertools.product(
    (False, True),          # bf16 state
    (False, True),          # online C128
    (False, True),          # speculative (EAGLE, 2 draft tokens)
    (0, 2, 4),              # HiSparse host-to-device ratio (0 = off)
    (1, 2),                 # attention DP width (TP 2 x dp)
    (None, 0.1, 0.25),      # operator's swa ratio (None = SGLang's cap mode)
) if not (c[1] and c[2])]   # online C128 with speculative decoding is refused by both


@pytest.mark.parametrize("config", [FLASH, PRO], ids=["flash", "pro"])
def test_configurator_parity_with_sglang(config, env_flags):
    """Every MemoryPoolConfig field equals SGLang's, for budgets and token counts, over the grid."""
    g = torch.Generator().manual_seed(7)
    sized = 0
    for bf16, online, spec, hisparse, dp, ratio in GRID:
        env_flags(bf16, online)
        R = int(torch.randint(16, 512, (1,), generator=g)) * dp
        budget = int(torch.randint(30 << 30, 140 << 30, (1,), generator=g))
        ab, to, theirs, ours, refusal = _both(config, _server_fields(R, dp, ratio, spec, hisparse), budget, dp)
        case = dict(bf16=bf16, online=online, spec=spec, hisparse=hisparse, dp=dp, ratio=ratio, R=R, budget=budget)
        if refusal is not None:
            continue
        sized += 1
        (a, t), (b, o) = ab, to
        assert b == a, case
        assert o == t, case
        assert ours.sizing.bytes_per_full_token() == pytest.approx(theirs.bytes_per_full_token, rel=1e-12), case
        assert b.c4_max_total_num_tokens == b.full_max_total_num_tokens // (4 * max(hisparse, 1)), case
    assert sized >= len(GRID) * 3 // 4, f"only {sized} of {len(GRID)} cases were sized by SGLang"


def test_flash_figure_by_hand(env_flags):
    """7,086.75 B per full token on Flash, one rank, fp32 state, operator ratio 0.1, derived here:
    SWA 149,760 / 256 = 585 B x 43 layers, C4 ring 8 / 256 x (8,192 + 2,048) B x 21, both x 0.1;
    C4 37,440 / 64 / 4 x 21; C128 1,728 / 2 / 128 x 20; indexer 132 / 4 x 21."""
    env_flags(False, False)
    want = 0.1 * (585 * 43 + 8 / 256 * 10240 * 21) + 585 / 4 * 21 + 864 / 128 * 20 + 33 * 21
    assert want == 7086.75
    *_, theirs, ours, refusal = _both(FLASH, _server_fields(256, 1, 0.1, False, 0), 100 << 30)
    assert refusal is None
    assert theirs.bytes_per_full_token == want
    assert ours.sizing.bytes_per_full_token() == want


def test_hook_picks_our_configurator_only_under_our_backend(env_flags):
    env_flags(False, False)
    kvc = _kvc(FLASH)
    with get_context().override_server_args(**_server_fields(256, 1, 0.1, False, 0),
                                            attention_backend="dsv4_triton"):
        assert isinstance(sgl_cfg.create_memory_pool_configurator(kvc), A.TritonDSV4PoolConfigurator)
    with get_context().override_server_args(**_server_fields(256, 1, 0.1, False, 0), attention_backend="dsv4"):
        assert type(sgl_cfg.create_memory_pool_configurator(kvc)) is sgl_cfg.DSV4PoolConfigurator


def test_configurator_refuses_unserved_modes(env_flags):
    env_flags(False, False)
    v41 = dict(FLASH, compress_ratios=[2] + FLASH["compress_ratios"][1:])
    with get_context().override_server_args(**_server_fields(256, 1, 0.1, False, 0)):
        with pytest.raises(ValueError, match="ratios 1/2"):
            A.TritonDSV4PoolConfigurator(_kvc(v41))
        ours = A.TritonDSV4PoolConfigurator(_kvc(FLASH))
        with pytest.raises(ValueError, match="page_size 128"):
            ours.calculate_pool_sizes(100 << 30, 128)


# ---- SGLang's pools and our kernels on them --------------------------------------------------

def _sglang_pools(swa_tokens=512, full_tokens=1024):
    """SGLang's SWA, C4, C128 and C4-indexer pools of one layer each, on the CPU."""
    with get_context().override_server_args(page_size=256):
        kv = dict(dtype=torch.float8_e4m3fn, qk_nope_head_dim=448, qk_rope_head_dim=64, layer_num=1,
                  device="cpu", enable_memory_saver=False, global_page_size=256)
        swa = DeepSeekV4SingleKVPool(swa_tokens, 256, **kv)
        c4 = DeepSeekV4SingleKVPool(full_tokens // 4, 64, **kv)
        c128 = DeepSeekV4SingleKVPool(full_tokens // 128, 2, **kv)
        idx = DeepSeekV4IndexerPool(full_tokens // 4, 64, torch.float8_e4m3fn, 128, 1, "cpu", False,
                                    use_fp4_indexer=False, global_page_size=256)
    return swa.kv_buffer[0], c4.kv_buffer[0], c128.kv_buffer[0], idx.index_k_with_scale_buffer[0]


def test_sglang_pool_pages_are_the_documented_bytes():
    swa, c4, c128, idx = _sglang_pools()
    assert (swa.shape[1], c4.shape[1], c128.shape[1], idx.shape[1]) == (149_760, 37_440, 1_728, 8_448)
    assert swa.shape[1] == attention_page_bytes(256) and c128.shape[1] == attention_page_bytes(2)
    assert all(p.dtype == torch.uint8 and p.is_contiguous() for p in (swa, c4, c128, idx))
    sizing = SGLangPoolSizing(SGLangPoolInputs(layer_ratios=(0, 4, 128), sliding_window=128,
                                               max_running_requests=1))
    assert sizing.kv_bytes_per_row(0) == 585 and sizing.kv_bytes_per_row(4) == 585
    assert sizing.kv_bytes_per_row(128) == 864


@pytest.mark.parametrize("pool_index,rows_per_page", [(0, 256), (1, 64), (2, 2)], ids=["swa", "c4", "c128"])
def test_kv_store_on_sglang_pages(pool_index, rows_per_page):
    """Our store on an SGLang page: the page's first P*584 bytes are the documented layout of
    its rows (all parts, then all scale groups) and the 576-byte-block padding is untouched."""
    pool = _sglang_pools()[pool_index]
    g = torch.Generator().manual_seed(11 + pool_index)
    pool.copy_(torch.randint(0, 256, pool.shape, generator=g, dtype=torch.uint8))
    before = pool.clone()
    page = pool.shape[0] - 2
    rows = torch.randn(rows_per_page, 512, generator=g, dtype=torch.float64) * 3
    slots = page * rows_per_page + torch.randperm(rows_per_page, generator=g)
    kv_store_rows(pool, slots, rows[slots - page * rows_per_page])
    used = rows_per_page * 584
    assert torch.equal(pool[page, :used], pack_kv_page(rows))
    assert torch.equal(pool[page, used:], before[page, used:]), "padding written"
    others = torch.ones(pool.shape[0], dtype=torch.bool)
    others[page] = False
    assert torch.equal(pool[others], before[others]), "another page written"


def test_backend_store_cache_writes_sglang_swa_slots():
    """TritonDSV4AttnBackend.store_cache: SGLang's SWA locations, the layer's SGLang buffer."""
    swa = _sglang_pools()[0]
    backend = object.__new__(A.TritonDSV4AttnBackend)
    backend.pre_kv_store_hook = None
    locs = torch.tensor([3, 300, 511], dtype=torch.int32)
    backend.forward_metadata = NS(core_attn_metadata=NS(swa_out_cache_loc=locs))
    backend.token_to_kv_pool = NS(request_window=None, get_swa_raw_buffer=lambda layer_id: swa)
    batch = NS(out_cache_loc=torch.tensor([10, 20, 30]), forward_mode=NS(is_idle=lambda: False))
    rows = torch.randn(3, 512, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    backend.store_cache(7, rows, batch)
    want = torch.zeros_like(swa)
    write_kv_rows(want, locs.long(), rows)
    assert torch.equal(swa, want)


def test_sparse_decode_on_sglang_pools():
    """Window rows in SGLang's 256-row SWA pages, top-k rows in its 64-row C4 pages."""
    swa, c4, _, _ = _sglang_pools()
    g = torch.Generator().manual_seed(21)
    write_kv_rows(swa, torch.arange(swa.shape[0] * 256), torch.randn(swa.shape[0] * 256, 512, generator=g) * 2)
    write_kv_rows(c4, torch.arange(c4.shape[0] * 64), torch.randn(c4.shape[0] * 64, 512, generator=g) * 2)
    b, h, w_len, k = 2, 8, 40, 24
    win = torch.randint(0, swa.shape[0] * 256, (b, w_len), generator=g, dtype=torch.int32)
    win[1, 30:] = -1
    ext = torch.randint(0, c4.shape[0] * 64, (b, k), generator=g, dtype=torch.int32)
    ext[0, ::5] = -1
    q = torch.randn(b, h, 512, generator=g) * 3
    sink = torch.randn(h, generator=g)
    scale = 512 ** -0.5
    got = sparse_decode(q, swa, win, c4, ext, sink, scale, num_splits=2,
                        config=DecodeAttentionConfig(block_n=16))
    ref = R.sparse_decode_ref(q, swa, win, c4, ext, sink, scale)
    keys = torch.cat([read_kv_rows(swa, win.clamp_min(0).long()), read_kv_rows(c4, ext.clamp_min(0).long())], 1)
    valid = torch.cat([win >= 0, ext >= 0], 1)
    out_b, lse_b = attention_bound(q, keys, valid, sink, scale, bf16_p=False, bf16_out=False)
    assert_within(got.out, ref.out, out_b, "out")
    assert_within(got.lse, ref.lse, lse_b, "lse")


def test_indexer_scores_on_sglang_indexer_pages():
    _, _, _, idx = _sglang_pools()
    g = torch.Generator().manual_seed(31)
    n = idx.shape[0] * 64
    write_indexer_rows(idx, torch.arange(n), torch.randn(n, 128, generator=g))
    b, h, L = 2, 4, 70
    q = indexer_fake_quant(torch.randn(b, h, 128, generator=g))
    w = torch.randn(b, h, generator=g)
    row_ids = torch.randint(0, n, (b, L), generator=g)
    row_ids[1, 50:] = -1
    got = indexer_scores(q, w, idx, row_ids=row_ids)
    ref = R.indexer_scores_ref(q, w, idx, row_ids)
    keys = read_indexer_rows(idx, row_ids.clamp_min(0).long())
    assert_within(got, ref, indexer_score_bound(q, w, keys), "scores")


def test_torchvision_stub_only_when_absent():
    import importlib.util
    tv = sys.modules.get("torchvision")
    if importlib.util.find_spec("torchvision") is not None and getattr(tv, "__file__", None):
        pytest.skip("a real torchvision is installed; the stub is not used")
    with pytest.raises(ImportError, match="torchvision"):
        tv.transforms.Compose([])


# ---- the backend's methods on SGLang's token-to-KV pool ---------------------------------------

@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_backend_attention_on_sglang_pool(ratio):
    """TritonDSV4AttnBackend.forward on SGLang's DeepSeekV4TokenToKVPool and DSV4AttnMetadata:
    per-query SWA and C4 / C128 lists cut at their topk_lengths, -1 skipped, a length-1 clamp
    over a -1 entry, metadata one row past the queries; out against float64 within the bound;
    FlashMLA's head padding past the sink comes back 0."""
    case = C.attention_case(C.dsv4_pool(), ratio, torch.Generator().manual_seed(41 + ratio), T=3, H=16,
                            heads=12, swa_lengths=[40, 64, 7, 64], extra_width=64,
                            extra_lengths=[64, 1, 30, 64])
    got, heads = case["got"], case["heads"]
    assert got.shape == (3, 16, 512)
    assert_within(got[:, :heads], case["want"], case["bound"], "out")
    assert torch.equal(got[:, heads:], torch.zeros(3, 16 - heads, 512)), "padded heads"


def test_backend_falls_back_to_sglang_outside_our_modes(monkeypatch):
    pool = C.dsv4_pool()
    core = C.core_metadata(torch.zeros(1, 64, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    backend = C.make_backend(pool, forward_metadata=NS(core_attn_metadata=core))
    assert backend.serves_attention(4, None) and backend.serves_attention(0, None)
    assert not backend.serves_attention(4, torch.zeros(1))  # fused-RoPE "mega" attention
    assert not backend.serves_attention(2, None)  # DSV4.1 ratio
    backend.trtllm_attn = True
    assert not backend.serves_attention(0, None)
    assert backend.serves_indexer(NS(use_fp4_indexer=False))
    assert not backend.serves_indexer(NS(use_fp4_indexer=True))
    from sglang.kernels.ops.attention.dsv4 import CompressorDecodePlan, CompressorPrefillPlan
    c4 = NS(ratio=4, ape_converted=True, is_in_indexer=False)
    plan = torch.zeros(1, 16, dtype=torch.uint8)
    backend.enable_deepseek_v4_fp4_indexer = False
    backend.forward_metadata = NS(c4_compress_metadata=CompressorDecodePlan(4, plan),
                                  c128_compress_metadata=CompressorDecodePlan(128, plan))
    assert backend.serves_compressor(1, c4)
    assert backend.serves_compressor(1, NS(ratio=4, ape_converted=True, is_in_indexer=True))
    def c128_with_state(width):
        state = NS(kv_score_buffer=NS(kv_score=torch.zeros(2, width)))
        return NS(ratio=128, head_dim=512, ape_converted=True, is_in_indexer=False,
                  get_state_pool=lambda backend: state)
    c128, c128_online = c128_with_state(2 * 512), c128_with_state(3 * 512)
    assert backend.serves_compressor(2, c128)
    monkeypatch.setenv("SGLANG_OPT_USE_ONLINE_COMPRESS", "1")
    assert backend.serves_compressor(2, c128_online)  # online C128 on SGLang's online state
    assert not backend.serves_compressor(2, c128)  # the flag without SGLang's online state
    backend.online_c128_mtp = object()
    assert not backend.serves_compressor(2, c128_online)  # online C128 with MTP stays SGLang's
    del backend.online_c128_mtp
    monkeypatch.delenv("SGLANG_OPT_USE_ONLINE_COMPRESS")
    assert backend.serves_compressor(2, c128)
    assert not backend.serves_compressor(1, NS(ratio=4, ape_converted=False, is_in_indexer=False))
    backend.forward_metadata = NS(c4_compress_metadata=CompressorPrefillPlan(4, plan, plan[:, :8]),
                                  c128_compress_metadata=CompressorPrefillPlan(128, plan, plan[:, :8]))
    assert backend.serves_compressor(1, c4)  # prefill plans are ours
    assert backend.serves_compressor(2, c128)
    monkeypatch.setenv("SGLANG_OPT_USE_ONLINE_COMPRESS", "1")
    assert backend.serves_compressor(2, c128_online)
    monkeypatch.delenv("SGLANG_OPT_USE_ONLINE_COMPRESS")


def test_backend_c4_indexer_top_k_on_sglang_pool():
    """forward_c4_indexer (SGLang's query preparation, with the model's projections given) on
    SGLang's indexer pool, page table and compressed lengths, writing the metadata's
    c4_sparse_page_indices in place: a best-index_topk set by the float64 scores within our
    kernel's bound (all visible rows when fewer), -1 after, a padded metadata row left alone;
    and the same set as SGLang's own torch indexer except for near-ties within both bounds."""
    case = C.indexer_case(C.dsv4_pool(), torch.Generator().manual_seed(51), T=3, H=4, k=64,
                          visible=[70, 5, 128], pages=2)
    assert C.indexer_findings(case) == []


def test_metadata_builds_without_flash_mla_under_our_backend():
    """SGLang's init_flashmla_related (run by every metadata build) imports flash_mla for its
    tile schedules; under dsv4_triton a missing flash_mla leaves them None (our kernels do not
    read them), under SGLang's own backend the ImportError stands."""
    import importlib.util
    if importlib.util.find_spec("flash_mla") is not None:
        pytest.skip("flash_mla is installed: the schedule is built")
    core = C.core_metadata(torch.zeros(2, 64, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    core.c4_topk_lengths_clamp1 = torch.tensor([3, 1], dtype=torch.int32)
    with get_context().override_server_args(attention_backend="dsv4_triton"):
        core.init_flashmla_related()
    assert core.c4_flashmla_metadata is None and core.c0_flashmla_metadata is None
    assert core.c4_sparse_page_indices.shape == (2, 512) and bool((core.c4_sparse_page_indices == -1).all())
    with get_context().override_server_args(attention_backend="dsv4"):
        with pytest.raises(ImportError):
            core.init_flashmla_related()


@pytest.mark.parametrize("indexer", [False, True], ids=["c4", "indexer"])
def test_backend_c4_decode_compressor_on_sglang_pool(indexer):
    """forward_core_compressor / forward_indexer_compressor on a C4 decode step: SGLang's
    DecodePlan (seq_len, write_loc, read_page_0 / 1), its state ring, its permuted ape and its
    c4_out_loc. Each request's new [C | Z] lands at write_loc (state otherwise untouched); the
    blocks closed this step (seq_len % 4 == 0; the first block without a previous one) are
    pooled, normed, rotated and stored at their rows within the bounds of the float64 chain;
    nothing else in the pool is written."""
    from bounds import assert_indexer_pools_close, assert_kv_pools_close
    case = C.compressor_case(C.dsv4_pool(), torch.Generator().manual_seed(61 + indexer), indexer,
                             seq_lens=[4, 8, 13, 16, 6])
    assert torch.equal(case["state"], case["want_state"])
    close = assert_indexer_pools_close if indexer else assert_kv_pools_close
    close(case["pool"], case["ref_pool"], case["dest"], case["bound"], "compressed rows")


def test_backend_c128_decode_compressor_on_sglang_pool():
    """forward_core_compressor on a C128 decode step: SGLang's DecodePlan (write_loc, read_page_1),
    its 128-slot state pages, its unpermuted ape and its c128_out_loc. Each request's new [C | Z]
    lands at write_loc; the blocks closed this step (seq_len % 128 == 0) pool all 128 slots of
    their page (the new row among them) and are stored at their C128 rows within the bounds of
    the float64 chain; nothing else in the 2-row SGLang pages is written."""
    from bounds import assert_kv_pools_close
    case = C.compressor_case(C.dsv4_pool(), torch.Generator().manual_seed(67), False,
                             seq_lens=[128, 300, 1024, 256], ratio=128)
    assert len(case["dest"]) == 3
    assert torch.equal(case["state"], case["want_state"])
    assert_kv_pools_close(case["pool"], case["ref_pool"], case["dest"], case["bound"], "C128 rows")


def _assert_prefill_decode(case, what):
    from bounds import assert_indexer_pools_close, assert_kv_pools_close
    outside = torch.ones(case["state"].shape[0], dtype=torch.bool)
    outside[case["ring"]] = False
    assert torch.equal(case["state"][outside], case["before"][outside]), "state outside the rings"
    close = assert_indexer_pools_close if case["indexer"] else assert_kv_pools_close
    close(case["pool"], case["ref_pool"], case["dest"], case["bound"], what)


@pytest.mark.parametrize("indexer", [False, True], ids=["c4", "indexer"])
def test_backend_c4_prefill_then_decode_compressor_on_sglang_pool(indexer):
    """forward_unified on extend steps (SGLang's CompressorPrefillPlan: compress rows with
    buffer_len / read pages, write rows, two padding rows each) then decode steps, C4: a 10-token
    prompt (ends mid-block) and a 6 + 7 chunked prompt whose second chunk's blocks read 6 and 2
    candidates from the ring, then three decode steps closing one block each. Every closed block
    (prefill and decode) is within the bounds of the chain on the whole raw sequence; the state
    outside the requests' rings (slot 0 among them) is untouched."""
    case = C.prefill_decode_case(C.dsv4_pool(), torch.Generator().manual_seed(71 + indexer), indexer, 4,
                                 [("extend", [10, 6]), ("extend", [0, 7]), ("decode", [1, 1]),
                                  ("decode", [1, 1]), ("decode", [0, 1])])
    assert len(case["dest"]) == 3 + 4
    _assert_prefill_decode(case, "C4 rows")


def test_backend_c128_prefill_then_decode_compressor_on_sglang_pool():
    """The same for C128: prompts of 200 (a block closes in the extend, 72 tokens left in the
    ring) + 55 and of 100 + 60 (the second chunk's block reads 100 ring candidates), then one
    decode step that closes the first request's second block from ring rows of three steps."""
    case = C.prefill_decode_case(C.dsv4_pool(), torch.Generator().manual_seed(73), False, 128,
                                 [("extend", [200, 100]), ("extend", [55, 60]), ("decode", [1, 1])])
    assert len(case["dest"]) == 3
    _assert_prefill_decode(case, "C128 rows")


def test_backend_online_c128_prefill_then_decode_on_sglang_pool(monkeypatch):
    """The same for online C128 (SGLANG_OPT_USE_ONLINE_COMPRESS): SGLang's pool with its online
    state (one [max | sum | mean] row a request) and its online plans (prefill: block-closing
    segments and each request's trailing partial segment; decode: one row a request). Prompts
    of 200 (a closing segment, then a partial one) + 55 and of 100 + 60 (a segment continuing
    the state of the previous step, closing its block), then two decode steps: the first closes
    the first request's second block from the state of three steps, the second starts its next
    block (SGLang leaves the closed block's state; ours must not fold it in)."""
    monkeypatch.setenv("SGLANG_OPT_USE_ONLINE_COMPRESS", "1")
    case = C.prefill_decode_case(C.dsv4_pool(online=True), torch.Generator().manual_seed(79), False, 128,
                                 [("extend", [200, 100]), ("extend", [55, 60]), ("decode", [1, 1]),
                                  ("decode", [1, 1])], online=True)
    assert case["state"].shape[1] == 3 * 512 and len(case["dest"]) == 3
    _assert_prefill_decode(case, "online C128 rows")


# ---- the GPU check's imports on SGLang's CUDA branch ------------------------------------------

_CUDA_BRANCH_PROBE = """
import importlib.util, json, sys
sys.path.insert(0, "bench")
import sglang_cuda_branch as B, gpu_sglang_check as G, sglang_stubs
with B.forced():
    imports = G.import_sglang()
from sglang.srt.layers.layernorm import rmsnorm
try:
    rmsnorm()
    error = None
except Exception as e:
    error = [type(e).__name__, str(e)]
print(json.dumps(dict(imports, use=sglang_stubs.report(), device=G.DEV, call_error=error,
                      scalar_type_absent=importlib.util.find_spec("sgl_kernel.scalar_type") is None)))
"""


def test_cuda_import_path_with_sgl_kernel_stand_in():
    """bench/gpu_sglang_check.py's imports with SGLang on its CUDA branch (torch answering as an
    H200 while SGLang loads, bench/sglang_cuda_branch.py), in a process of its own (~10-20 s).
    Without sgl_kernel they fail (SGLang imports its names unguarded on CUDA); with the
    stand-in of bench/sgl_stubs they succeed, and an SGLang function bound to a missing kernel
    raises naming it."""
    import importlib.util
    import subprocess
    if importlib.util.find_spec("sgl_kernel") is not None:
        pytest.skip("a real sgl_kernel is installed; the stand-in is not used")
    run = subprocess.run([sys.executable, "-c", _CUDA_BRANCH_PROBE], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["cuda_branch"] is True and got["device"] == "cpu"
    assert list(got["stand_ins"]) == ["sgl_kernel"]
    for module, status in got["kernel_modules"].items():
        if module.endswith("flash_mla_interface"):  # needs the flash_mla package
            assert status == "ok" or "flash_mla" in status, status
        else:
            assert status == "ok", (module, status)
    handed = got["use"]["sgl_kernel"]["handed_out"]
    assert any("sglang/srt/layers/layernorm.py:" in w for w in handed["sgl_kernel.rmsnorm"]), handed
    assert "sgl_kernel.quantization.ggml_dequantize" in handed  # a submodule, as gguf.py imports it
    assert got["scalar_type_absent"]  # SGLang's own import-time fallback applies
    assert got["call_error"][0] == "MissingKernelError" and "sgl_kernel.rmsnorm" in got["call_error"][1]
    assert got["use"]["sgl_kernel"]["called"] == ["sgl_kernel.rmsnorm"]
