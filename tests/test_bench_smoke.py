"""Synthetic contexts, the per-layer-type timer, and the two engine benchmarks end to end (tiny, CPU).

A synthetic request must take exactly what a real prefill of the same length takes (every pool's
used count), hold valid rows (bytes that are a fixed point of the pools' own quantisation), decode
through the scheduler, survive a retraction, and give everything back.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from bench import bench_long_context, bench_offline
from bench._bench_common import CATEGORIES, LayerTimer
from memory.layout import read_indexer_rows, read_kv_rows, write_indexer_rows, write_kv_rows
from scheduler_hooks.engine import Engine
from scheduler_hooks.io import GenerateRequest, SamplingParams

VOCAB = 1024


def make_engine(dense: bool = False, **kw) -> Engine:
    args = dict(preset="tiny", skip_tokenizer_init=True, max_total_tokens=4096, chunked_prefill_size=256,
                max_running_requests=2, config_overrides={"vocab_size": VOCAB}, dense=dense)
    args.update(kw)
    return Engine(**args)


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def assert_all_free(eng: Engine) -> None:
    eng.check_integrity()
    usage = eng.pool_usage()
    assert all(v["used"] == 0 for v in usage.values()), usage


def held_rows(eng: Engine, rid: str, n: int) -> dict[str, torch.Tensor]:
    """Slots / rows of the first n positions of rid that the pools hold."""
    slot = eng.allocator.req_slot(rid)
    full = eng.allocator.req_to_token[slot, :n]
    swa = eng.allocator.full_to_swa[full]
    out = {"swa": swa[swa >= 0]}
    if not eng.dense:
        out["c4"] = full[3::4] // 4          # rows of complete C4 blocks
        out["c128"] = full[127::128] // 128
    return out


def assert_valid_rows(pool: torch.Tensor, slots: torch.Tensor, indexer: bool = False) -> None:
    """Rows decode to finite, non-trivial values that the pool's own quantiser stores exactly
    (a fixed point: random bytes would hold NaN codes or values off the FP8 grid of their scale)."""
    read, write = (read_indexer_rows, write_indexer_rows) if indexer else (read_kv_rows, write_kv_rows)
    rows = read(pool, slots)
    assert torch.isfinite(rows).all() and rows.std() > 0.1
    copy = pool.clone()
    write(copy, slots, rows)
    assert torch.equal(read(copy, slots), rows)


@pytest.mark.parametrize("dense, online", [(False, False), (False, True), (True, False)])
def test_synthetic_admission_equals_prefill_and_frees(dense, online, monkeypatch):
    monkeypatch.setenv("SGLANG_OPT_USE_ONLINE_COMPRESS", "1" if online else "0")
    n = 700   # crosses five SWA pages, two full pages, five C128 blocks; 700 % 4 == 0
    # a synthetic request is never cached: compare with a prefill that is not cached either
    real, syn = make_engine(dense, disable_radix_cache=True), make_engine(dense)
    ids = [random.Random(1).randrange(VOCAB) for _ in range(n)]
    real.scheduler.add(GenerateRequest(ids, SamplingParams(**greedy(9)), rid="r"))
    while real.scheduler.reqs["r"].kv_len < n:
        real.step()
    rid = syn.add_synthetic_request(n, greedy(9))
    outs = syn.step()                               # the admission step: no forward, one stand-in token
    assert [o.rid for o in outs] == [rid] and len(outs[0].output_ids) == 1
    assert syn.scheduler.reqs[rid].kv_len == n and syn.scheduler.reqs[rid].remaining == 1
    assert syn.pool_usage() == real.pool_usage()

    rows = held_rows(syn, rid, n)
    for layer in syn.pools.swa_kv:
        assert_valid_rows(syn.pools.swa_kv[layer], rows["swa"])
    if not dense:
        for layer in syn.pools.c4_kv:
            assert_valid_rows(syn.pools.c4_kv[layer], rows["c4"])
            assert_valid_rows(syn.pools.c4_indexer[layer], rows["c4"], indexer=True)
        for layer in syn.pools.c128_kv:
            assert_valid_rows(syn.pools.c128_kv[layer], rows["c128"])
        for layer, t in syn.pools.c128_online.items():
            assert (t[syn.allocator.req_slot(rid), 1] > 0).all()    # running sums are positive

    steps, launched = 0, syn.scheduler.num_steps
    while syn.scheduler.reqs:                       # 8 decode steps: two C4 blocks complete
        outs = syn.step()
        steps += 1
        assert all(o.rid == rid for o in outs)
        if steps < 8:
            assert syn.pool_usage()["full"]["used"] > 0
    # the overlap schedule reads the last step's token in one more call (that launches nothing)
    assert syn.scheduler.num_steps - launched == 8 and steps == 8 + syn.scheduler.overlap.enabled
    assert outs[-1].finished and len(outs[-1].output_ids) == 9
    assert_all_free(syn)
    real.shutdown()


def test_synthetic_request_retracted_and_readmitted():
    # pools of two full pages: the second request's decode needs a page the first holds
    eng = make_engine(max_total_tokens=512, swa_ratio=1.0, chunked_prefill_size=512)
    a = eng.add_synthetic_request(240, greedy(24))
    b = eng.add_synthetic_request(236, greedy(26))
    done = {}
    while eng.scheduler.reqs or eng.scheduler.waiting:
        for o in eng.step():
            if o.finished:
                done[o.rid] = o
    assert eng.scheduler.num_retractions >= 1
    assert len(done[a].output_ids) == 24 and len(done[b].output_ids) == 26
    assert all(o.finish_reason["type"] == "length" for o in done.values())
    assert_all_free(eng)


def test_synthetic_request_rejects_logprobs_and_running_loop():
    eng = make_engine()
    with pytest.raises(ValueError, match="logprob"):
        eng.scheduler.add(GenerateRequest([1, 2, 3], SamplingParams(), return_logprob=True), synthetic=True)
    eng.start()
    try:
        with pytest.raises(RuntimeError, match="offline"):
            eng.add_synthetic_request(16)
    finally:
        eng.shutdown()


def test_layer_timer_splits_the_step_and_removes_itself():
    eng = make_engine(max_running_requests=1)
    eng.add_synthetic_request(600, greedy(6))
    eng.step()
    eng.step()                 # a decode: with the overlap schedule each later step reads one token
    runner_forward = eng.runner.forward
    with LayerTimer(eng) as lt:
        for _ in range(2):
            assert len(lt.step()) == 1
    bd = lt.breakdown()
    assert bd.steps == 2 and bd.step_ms > 0
    top = [k for k, _ in CATEGORIES]
    assert set(top) <= set(bd.ms)
    # the top-level parts tile the step
    assert sum(bd.ms[k] for k in top) == pytest.approx(bd.step_ms, rel=1e-6)
    for k in ("attn_window", "attn_csa", "attn_hca", "moe", "metadata"):
        assert bd.ms[k] > 0, k
    assert 0 < bd.ms["indexer_topk"] < bd.ms["attn_csa"]
    # hooks and wrappers are gone
    assert eng.runner.forward == runner_forward and "forward" not in vars(eng.runner)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in eng.runner.model.modules())
    eng.shutdown()


def test_kernel_breakdown_runs_and_cleans_up():
    """KernelBreakdown (the graph steps' breakdown) on the CPU: the profiled steps run and return
    their tokens, no GPU kernel is found (so every part is 0 and the whole step is "outside the
    kernels"), and the hooks, wrappers and the graphs flag are restored. Its GPU figures are in
    docs/PERF.md."""
    from bench._bench_common import KernelBreakdown
    from dsv4_backend.cuda_graph import DecodeGraphs

    eng = make_engine()
    eng.add_synthetic_request(600, greedy(4))
    eng.step()
    eng.step()                 # a decode: with the overlap schedule each later step reads one token
    eng.runner.cuda_graphs = DecodeGraphs(eng.runner, max_bs=2, capture=False)   # switched off inside
    with KernelBreakdown(eng) as kb:
        assert eng.runner.cuda_graphs.enabled is False
        assert len(kb.step()) == 1
    bd = kb.breakdown(12.5)
    assert kb.kernel_ms() == 0.0 and bd.ms["sched_sampling"] == 12.5 and bd.steps == 1
    assert eng.runner.cuda_graphs.enabled is True
    eng.runner.cuda_graphs = None
    assert "forward" not in vars(eng.runner) and "init_forward_metadata" not in vars(eng.runner.backend)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in eng.runner.model.modules())
    eng.shutdown()


def test_bench_offline_end_to_end(tmp_path):
    out = tmp_path / "off.json"
    res = bench_offline.main(["--contexts", "300", "--batches", "2", "--steps", "2", "--breakdown-steps", "1",
                              "--real-prefill-max-tokens", "1000", "--no-progress", "--out", str(out)])
    kinds = {(r.mode, r.via) for r in res}
    assert kinds == {("compressed", "prefill"), ("dense", "prefill"), ("compressed", "synthetic"),
                     ("dense", "synthetic")}
    assert all(r.tokens_per_s > 0 and r.breakdown for r in res)
    data = json.loads(out.read_text())
    assert len(data["results"]) == 4


def test_bench_long_context_end_to_end(tmp_path):
    out, png = tmp_path / "long.json", tmp_path / "long.png"
    rep = bench_long_context.main([
        "--preset", "tiny", "--device", "cpu", "--contexts", "512,1024", "--steps", "2", "--warmup", "1",
        "--max-batch", "4", "--breakdown-contexts", "1024", "--breakdown-steps", "1",
        "--prefill-contexts", "512", "--prefill-long", "1024", "--prefill-max-seconds", "0.01",
        "--prefill-chunk", "256", "--no-progress", "--out", str(out), "--plot", str(png)])
    ok = [r for r in rep.decode if r.status == "ok"]
    assert {r.mode for r in ok} == {"compressed", "dense"}
    assert {(r.context, r.batch) for r in ok if r.mode == "compressed" and r.batch_kind == "1"} == {(512, 1), (1024, 1)}
    # the dense plan holds fewer requests: its row at the compressed maximum is the plan's refusal
    assert any(r.mode == "dense" and r.status == "refused by plan" for r in rep.decode)
    assert any(r.breakdown for r in ok if r.context == 1024)
    pre = {p.context: p for p in rep.prefill}
    assert pre[512].status == "complete" and pre[512].tokens_done == 512
    assert all(p.warmup_seconds > 0 for p in rep.prefill)   # the untimed two-chunk prefill ran first
    assert pre[1024].status.startswith("stopped") and 0 < pre[1024].tokens_done < 1024   # one chunk, then the budget
    assert png.stat().st_size > 1000
    data = json.loads(out.read_text())
    assert data["summary"] and len(data["decode"]) == len(rep.decode)
    # every measured row carries its byte floor at the run's copy bandwidth
    from bench._floor import decode_step_floor
    cfg, gbps = bench_long_context.model_config(bench_long_context.parse_args(["--preset", "tiny"])), data["meta"]["copy_gbps"]
    for r in ok:
        want = decode_step_floor(cfg, r.context, r.batch, torch.float32, dense=r.mode == "dense")
        assert r.floor["total_bytes"] == want.total_bytes and r.floor_ms == pytest.approx(want.ms(gbps))
        assert r.x_floor == pytest.approx(r.ms_per_step / r.floor_ms)
    assert all(d["floor_ms"] > 0 for d in data["decode"] if d["status"] == "ok")


def test_ids_between_is_a_slice_of_all_ids():
    from scheduler_hooks.scheduler import Req
    req = Req("x", [5, 6, 7, 8], GenerateRequest([5, 6, 7, 8], SamplingParams()), torch.Generator(), None)
    req.output_ids = [9, 10, 11]
    for a in range(8):
        for b in range(a, 8):
            assert req.ids_between(a, b) == req.all_ids[a:b], (a, b)


def test_sass_report_compiles_the_decode_kernel_for_hopper(tmp_path):
    """The default decode configuration and the indexer compile for sm_90a on a CPU-only machine
    (Triton's own ptxas), their products are Hopper matrix instructions, and the report reads
    ptxas' register counts. Runs without the interpreter, in a subprocess."""
    import os
    import subprocess
    import sys

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton build has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "bench" / "sass_report.py"), "--quick", "--dump-sass",
                          str(tmp_path)], capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = {ln.split()[0]: dict(f.split("=") for f in ln.split()[1:]) for ln in out.stdout.splitlines()}
    decode = lines["decode_64-64-8-1-word-True"]
    assert 0 < int(decode["regs"]) <= 255 and int(decode["HGMMA"]) > 0
    indexer = lines["indexer_pages_f16"]    # the exact products' default: fp16 (IndexerConfig.products)
    assert int(indexer["UTMALDG"]) > 0 and int(indexer["HGMMA"]) > 0 and indexer["spill"] == "0B"
    assert "HGMMA" in (tmp_path / "decode_64-64-8-1-word-True.sass").read_text()


def test_bench_quant_model_tiny_cpu(tmp_path):
    """The quantised-model benchmark end to end at the tiny shape: a 1-layer checkpoint written and
    streamed back, the other layers made in the same format, kernels, decode, prefill, per layer."""
    from bench import bench_quant_model

    out = tmp_path / "quant.json"
    rep = bench_quant_model.main([
        "--preset", "tiny", "--device", "cpu", "--workdir", str(tmp_path / "ckpt"), "--contexts", "256",
        "--batches", "1,max", "--max-batch", "2", "--prefill-context", "256", "--prefill-chunk", "128",
        "--steps", "1", "--warmup", "0", "--gemm-m", "1", "--moe-tokens", "2", "--kernel-iters", "1",
        "--breakdown", "1", "--out", str(out)])
    assert json.loads(out.read_text())["weights"]["disk_layers"] == 1
    w = rep["weights"]
    assert w["layers"] == 4 and w["checkpoint_bytes"] > 0 and not (tmp_path / "ckpt").exists()
    assert {r["kernel"] for r in rep["kernels"]} == {"fp8_linear", "fp4_moe"}
    assert all(r["impl"] == "torch" and r["ms"] > 0 and r["floor_ms"] > 0 for r in rep["kernels"])
    checks = rep["kernel_check"]   # the torch path against the spec: within the bound, MoE identical
    assert all(c["worst_err_over_bound"] <= 1 for c in checks if c["kernel"] == "fp8_linear")
    assert all(c["relative_error_norm"] == 0 for c in checks if c["kernel"] == "fp4_moe")
    assert [(d["batch"], d["status"]) for d in rep["decode"]] == [(1, "ok"), (2, "ok")]
    assert all(d["tokens_per_s"] > 0 and d["floor_ms"] > 0 for d in rep["decode"])
    split, = [d for d in rep["decode"] if d["breakdown"]]       # --breakdown: the batch-1 row only
    assert split["batch"] == 1 and split["breakdown"]["ms"]["moe"] > 0
    assert split["kernels"]["per_kind"] and split["kernels"]["per_step_total"] > 0
    assert rep["prefill"]["status"] == "complete" and rep["prefill"]["tokens_done"] == 256
    pl = rep["per_layer"]
    assert pl["per_layer_floor_ms"] > 0 and pl["derived_layers"] == 4 and pl["derived_step_ms"] > 0
    lo, hi = pl["per_layer_ms_range"]             # the median of the alternated rounds lies in their range
    assert pl["rounds"] == bench_quant_model.PER_LAYER_ROUNDS and lo <= pl["per_layer_ms"] <= hi
    assert pl["per_layer_from"] == "step time"    # eager on the CPU: no replay GPU time


def test_row_gemv_tuning_rule_routes_one_product(monkeypatch):
    """bench/tune_in_model.py's rule: with no override the default launch shape, with a
    Triton override that shape for that product only (the same sums in another order), a
    CUDA C shape refused by the real rule's check where fp8_row.cu cannot run; the candidates
    cover every product of Flash (the MoE's first), the largest weights first, each shape fitting
    the product's rows; the MoE's shapes replace the decode-size choice only; and the script runs
    end to end on the CPU (eager: no product, only the default)."""
    from bench import tune_in_model as tune
    from dsv4_backend.config import DSV4Config
    from dsv4_backend.kernels import fp8_gemv
    from dsv4_backend.kernels.fp8_gemv import CudaRowConfig, RowGemvConfig

    g = torch.Generator().manual_seed(5)
    N, K = 256, 1024
    w = (torch.randn(N, K, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.pow(2.0, torch.randint(-8, -2, (N // 128, K // 128), generator=g).float())
    x = torch.randn(1, K, generator=g).bfloat16()
    picked = []
    real = fp8_gemv.row_gemv_config
    counting = lambda n, k, sms: picked.append((n, k)) or real(n, k, sms)   # noqa: E731
    monkeypatch.setattr(fp8_gemv, "row_gemv_config", counting)
    real_cuda = fp8_gemv._cuda_config
    rule = tune.Rule()
    rule.install()
    try:
        y0 = fp8_gemv.fp8_row_gemv(x, w, s)
        assert rule.seen == {(N, K, 1): 1} and picked == [(N, K)]
        rule.override = {(N, K, 1): RowGemvConfig(16, 2, 2, 2)}
        y1 = fp8_gemv.fp8_row_gemv(x, w, s)
        assert picked == [(N, K)]                   # the override's shape, not the default rule's
        # another order of the same fp32 sums (each within K 2^-24 of the terms' magnitudes; x rounded
        # to e4m3 grows by at most 2^-4), then each rounded to bf16 (half a step: 2^-8 relative)
        mag = ((w.double() * s.repeat_interleave(128, 0).repeat_interleave(128, 1).double()).abs()
               @ x.double().abs().T).T * (1 + 2 ** -4)
        bound = 2 * K * 2 ** -24 * mag + 2 ** -8 * (y0.double().abs() + y1.double().abs())
        assert ((y0.double() - y1.double()).abs() <= bound).all()
        rule.override = {(N, K, 1): CudaRowConfig(2, 8, 1, 2)}
        with pytest.raises(ValueError, match="CUDA kernel takes"):
            fp8_gemv.fp8_row_gemv(x, w, s)
    finally:
        rule.uninstall()
    assert fp8_gemv.row_gemv_config is counting and fp8_gemv._cuda_config is real_cuda

    cfg = DSV4Config.preset("flash")
    names = tune.product_names(cfg)
    assert sorted(names.values()) == sorted(tune.PRODUCT_ORDER)
    seen = {shape: 43 for shape in names}
    cands = tune.candidates(seen, names, None)
    assert cands[0][0].startswith("wo_b ") and cands[-1][0].startswith("wq_a+wkv ")
    for _, (n, _, groups), c in cands:
        rows = c.rows if isinstance(c, CudaRowConfig) else c.block_n
        assert 128 % rows == 0 and (n // groups) % rows == 0
    assert {lab.split(" ")[0] for lab, _, _ in tune.candidates(seen, names, {"wo_a"})} == {"wo_a"}
    moe = tune.candidates({**seen, tune.MOE: 43}, names, None)
    assert [k for _, k, _ in moe[:len(tune.MOE_SHAPES)]] == [tune.MOE] * len(tune.MOE_SHAPES)
    assert moe[len(tune.MOE_SHAPES)][0].startswith("wo_b ") and len(moe) == len(cands) + len(tune.MOE_SHAPES)

    # the MoE's rule: an override at decode sizes only, counted; the routed (prefill) shapes untouched
    from dsv4_backend.kernels import fp4_mma
    rule = tune.Rule()
    rule.install()
    try:
        default = fp4_mma.pick_mma_configs(6)
        rule.set(tune.MOE, tune.MOE_SHAPES[4])
        assert fp4_mma.pick_mma_configs(6) == tune.MOE_SHAPES[4] != default
        assert fp4_mma.pick_mma_configs(4096)[0].routed and rule.seen == {tune.MOE: 2}
        rule.set(None, None)
        assert fp4_mma.pick_mma_configs(6) == default and rule.override == {}
    finally:
        rule.uninstall()
    assert fp4_mma.pick_mma_configs is rule._moe_configs

    rep = tune.main(["--preset", "tiny", "--device", "cpu", "--layers", "4", "--context", "256", "--rounds", "2",
                     "--steps", "1"])
    assert rep["candidates"] == [] and len(rep["default_ms_all"]) == 2 and rep["default_ms"] > 0


def test_per_layer_from_rounds():
    """The per-layer figure is the median of the rounds' differences over the layers, from the
    replays' GPU time when every round has it, else from the step times."""
    from bench.bench_quant_model import per_layer_from_rounds
    rounds = [dict(all_ms=3.0, half_ms=2.0, all_gpu_ms=2.6, half_gpu_ms=1.4),
              dict(all_ms=3.1, half_ms=2.0, all_gpu_ms=2.7, half_gpu_ms=1.5),
              dict(all_ms=2.9, half_ms=2.1, all_gpu_ms=2.6, half_gpu_ms=1.6)]
    pl = per_layer_from_rounds(rounds, layers=6)
    assert pl["by_gpu"] and pl["per_layer_ms"] == pytest.approx(0.2)        # (1.2, 1.2, 1.0) / 6
    assert pl["per_layer_ms_range"] == pytest.approx((1.0 / 6, 0.2))
    assert pl["all_gpu_ms"] == pytest.approx(2.6) and pl["half_ms"] == pytest.approx(2.0)
    rounds[1]["half_gpu_ms"] = None
    pl = per_layer_from_rounds(rounds, layers=6)
    assert not pl["by_gpu"] and pl["per_layer_ms"] == pytest.approx(1.0 / 6)   # (1.0, 1.1, 0.8) / 6


def test_bench_long_context_times_decodes_beside_a_prefill():
    """--mixed-prefill: two running decodes keep getting a token in every step of a chunked
    prefill beside them, under the old policy (the whole chunk) and then the capped one; the
    report has their TPOT before and during it and the long prompt's TTFT for each."""
    rep = bench_long_context.main([
        "--preset", "tiny", "--device", "cpu", "--contexts", "256", "--batches", "1", "--modes", "compressed",
        "--steps", "1", "--warmup", "1", "--breakdown-contexts", "", "--prefill-contexts", "", "--prefill-long", "0",
        "--mixed-prefill", "512", "--mixed-decode-context", "256", "--mixed-decode-batch", "2",
        "--prefill-chunk", "256", "--mixed-chunk-tokens", "128", "--max-batch", "4", "--no-progress"])
    old, capped = rep.mixed
    assert (old.mixed_chunk_tokens, old.chunk, capped.mixed_chunk_tokens, capped.chunk) == (0, 256, 128, 128)
    for m, steps in ((old, 2), (capped, 4)):                   # 512 prompt tokens in 256- / 128-token chunks
        assert m.status == "complete" and m.prefill_tokens_done == 512
        assert m.steps_mixed == steps and m.stalled_steps == 0  # the decodes got a token in every step
        assert m.tpot_alone_ms > 0 and m.tpot_mixed_max_ms >= m.tpot_mixed_p50_ms > 0
        assert m.ttft_s == m.prefill_s > 0
