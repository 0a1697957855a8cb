"""Tensor / expert parallel Engine on the CPU (gloo, one process per rank) against one rank.

In float64, ``Engine(tp_size=2)``, ``(tp_size=4)``, ``(tp_size=2, ep_size=2)`` and
``(ep_size=2)`` give the logits of ``Engine(tp_size=1)`` at every computed position within
1e-9, and the same greedy tokens, over prefix-cache hits, evictions and a flush (the cache is
rank 0's, the ranks replay its page operations), chunked prefill with mixed prefill / decode
batches, a retraction and aborts (waiting, mid-prefill, mid-decode). The ranks change only the
order of sums (partial sums all-reduced): a float64 sum of n terms moves by at most about
n eps sum|t|, with n <= 2048 (hidden 256 x hc 4 x 2) and sum|t| < 100 here about 5e-11 per
layer, so the tolerance leaves margin over 3 layers, and FP8 rounding of KV rows decides alike
on both sides.

One engine per parallel shape, shared by every scenario (process start-up is the cost):
a 3-layer tiny model (window-only, CSA, HCA), 1024-token vocabulary, o_groups 4 so that 4 ranks
split the output groups. Below, also a quantised FP8 / FP4 checkpoint under the split, the split
rules, the plan's per-rank weights and the refusals, and launches under torchrun (an engine
script and the server, each a subprocess: about 7 s and 20 s of the file). Whole file: 67 s
measured on the two-core machine at load about 3 (33 s at load about 1 before the torchrun tests);
rank processes fork from a forkserver (a rank starts in about a second), and every collective
waits for all ranks to get a core, so the time grows with the machine's load.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4_backend import Engine
from dsv4_backend.checkpoint import save_checkpoint
from dsv4_backend.config import DSV4Config
from dsv4_backend.layers.linear import Fp8Linear
from dsv4_backend.model import DSV4Model
from dsv4_backend.parallel import Comm, ParallelConfig, RankShard, VocabParallelEmbedding, free_port, split_of
from dsv4_backend.weights import model_tensors, random_weights
from scheduler_hooks.io import GenerateRequest, SamplingParams
from scheduler_hooks.parallel_engine import TORCHRUN_VARS, join_as

V = 1024
OVERRIDES = {"vocab_size": V, "num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0], "o_groups": 4}
EXACT_TOL = 1e-9
# synchronous steps for the one-rank reference too: ranks turn the overlap schedule off, and under
# it an abort's output would hold one token less (its token in flight is dropped)
ENGINE_ARGS = dict(preset="tiny", dtype="float64", skip_tokenizer_init=True, config_overrides=OVERRIDES,
                   capture_logits=True, max_total_tokens=512, max_running_requests=2, chunked_prefill_size=64,
                   disable_overlap_schedule=True)


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(V) for _ in range(n)] for n in lengths]


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0}


Outputs = list[tuple[str, list[int]]]    # (request id, output ids) in submission order


def generate(eng: Engine, lengths: list[int], new: list[int], seed: int) -> Outputs:
    return generate_ids(eng, prompts(lengths, seed), new)


def generate_ids(eng: Engine, ids: list[list[int]], new: list[int]) -> Outputs:
    outs = eng.generate(input_ids=ids, sampling_params=[greedy(n) for n in new])
    return [(o["meta_info"]["id"], o["output_ids"]) for o in outs]


MIXED = dict(lengths=[100, 33, 7], new=[3, 5, 2], seed=1)


def scenario_mixed(eng: Engine) -> Outputs:
    """Three prompts through chunks of 64 beside decodes of the others."""
    return generate(eng, **MIXED)


def scenario_retraction(eng: Engine) -> Outputs:
    """Two requests outgrowing two 256-token pages: the newer is retracted and recomputed."""
    before = eng.scheduler.num_retractions
    out = generate(eng, [254, 253], [4, 5], seed=4)
    assert eng.scheduler.num_retractions > before
    return out


def scenario_aborts(eng: Engine) -> Outputs:
    """Aborts while waiting, mid-prefill and mid-decode; the survivor runs on."""
    tag = "ab"
    for i, p in enumerate(prompts([90, 60, 40], seed=8)):
        eng.scheduler.add(GenerateRequest(p, SamplingParams(max_new_tokens=20, temperature=0.0), rid=f"{tag}{i}"))
    sched = eng.scheduler
    eng.step()
    out = [(r, sched.abort(r).output_ids) for r in (f"{tag}2", f"{tag}0")]    # waiting, mid-prefill
    for _ in range(3):
        eng.step()
    out.append((f"{tag}1", sched.abort(f"{tag}1").output_ids))               # decoding
    assert out[-1][1] and not sched.reqs and sched.idle
    return out


def scenario_prefix(eng: Engine) -> Outputs:
    """The prefix cache: a restore point at 256 taken over by a prompt sharing 280 ids (it
    prefills 44), an unrelated prompt that needs both full pages (the cache's are evicted), then
    a flush. Under TP / EP the cache is rank 0's and the ranks replay its page operations."""
    cache = eng.prefix_cache
    hits, evicted = cache.num_hits, cache.evicted_pages
    a, c = prompts([300, 400], seed=11)
    b = a[:280] + prompts([20], seed=12)[0]
    out = generate_ids(eng, [a], [3])
    got = eng.generate(input_ids=[b], sampling_params=[greedy(4)])[0]
    assert got["meta_info"]["cached_tokens"] == 256 and cache.num_hits == hits + 1
    out.append((got["meta_info"]["id"], got["output_ids"]))
    out += generate_ids(eng, [c], [3])
    assert cache.evicted_pages > evicted
    eng.flush_cache()
    return out


SCENARIOS = [scenario_prefix, scenario_mixed, scenario_retraction, scenario_aborts]


def run_all(eng: Engine) -> list[list[tuple[list[int], torch.Tensor]]]:
    """Per scenario, per request: its output ids and the logits of every position computed."""
    out = []
    for scenario in SCENARIOS:
        out.append([(ids, eng.scheduler.captured.get(rid)) for rid, ids in scenario(eng)])
        eng.check_integrity()
    return out


@pytest.fixture(scope="module")
def single() -> list:
    with Engine(**ENGINE_ARGS) as eng:
        return run_all(eng)


@pytest.mark.parametrize("tp, ep", [(2, 1), (4, 1), (2, 2), (1, 2)], ids=["tp2", "tp4", "tp2-ep2", "ep2"])
def test_parallel_engine_equals_one_rank(single, tp, ep):
    with Engine(**{**ENGINE_ARGS, "disable_overlap_schedule": False}, tp_size=tp, ep_size=ep) as eng:
        assert eng.ranks is not None and eng.ranks.config.world_size == max(tp, ep)
        assert eng.stats()["overlap"]["off_reason"] == "tensor / expert parallel ranks"
        got = run_all(eng)
        eng.check_integrity()
    procs = eng.ranks.procs
    assert all(not p.is_alive() for p in procs) and all(p.exitcode == 0 for p in procs)
    assert_same(single, got, f"tp{tp}/ep{ep}")


def test_one_rank_with_a_process_group(single):
    # the path a one-GPU NCCL run takes: every collective and the step broadcast, world size 1
    with join_as(ParallelConfig()):
        eng = Engine(**ENGINE_ARGS)
    with eng:
        assert eng.ranks is not None and isinstance(eng.runner.model.embed, VocabParallelEmbedding)
        got = run_all(eng)
    assert_same(single, got, "one rank + gloo")


def test_torchrun_launch_equals_one_rank(single, tmp_path):
    # torchrun starts both processes; each builds Engine(tp_size=2), rank 1's follows inside it
    args, out = tmp_path / "args.json", tmp_path / "out.pt"
    args.write_text(json.dumps({"engine": {**ENGINE_ARGS, "tp_size": 2},
                                "input_ids": prompts(MIXED["lengths"], MIXED["seed"]),
                                "max_new_tokens": MIXED["new"]}))
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS + ("LOCAL_RANK",)}
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(root / "tests" / "torchrun_generate.py"), str(args), str(out)]
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    got = torch.load(out)
    assert got["world_size"] == 2
    assert_same([single[SCENARIOS.index(scenario_mixed)]], [got["outputs"]], "torchrun tp2")


def test_torchrun_world_size_must_match(monkeypatch):
    import torch.distributed as dist

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    for tp in (1, 4):
        with pytest.raises(ValueError, match=rf"WORLD_SIZE=2 .* tp_size={tp}, ep_size=1 run .* = {tp} ranks"):
            Engine(**ENGINE_ARGS, tp_size=tp)
    assert not dist.is_initialized()


def test_server_under_torchrun_serves_on_rank_zero():
    # rank 0 serves HTTP (the official client), rank 1 follows; the greedy text is one rank's
    import openai
    from server import parse_args
    from test_server import LiveServer

    flags = ["--tp-size", "2", "--dtype", "float64", "--max-total-tokens", "1024", "--max-running-requests", "2",
             "--context-length", "512", "--chunked-prefill-size", "64"]
    ids = prompts([80], seed=21)[0]
    with Engine(**{**parse_args(flags).engine_kwargs(), "tp_size": 1}) as one:
        want = one.generate(input_ids=[ids], sampling_params=[greedy(4)])[0]
    s = LiveServer(flags, launcher=(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                    "--master-addr", "127.0.0.1", "--master-port", str(free_port())))
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model=client.models.list().data[0].id, prompt=ids, max_tokens=4,
                                        temperature=0)
    finally:
        s.stop()
    assert got.choices[0].text == want["text"] and got.usage.completion_tokens == len(want["output_ids"])


def assert_same(single: list, got: list, label: str) -> None:
    for scenario, want, have in zip(SCENARIOS, single, got):
        name = scenario.__name__
        assert [ids for ids, _ in have] == [ids for ids, _ in want], f"{name}: tokens differ"
        for i, ((_, w), (_, g)) in enumerate(zip(want, have)):
            assert w is not None and g is not None and g.shape == w.shape, (name, i)
            if not w.numel():
                continue     # aborted before its first forward
            d = (g - w).abs()
            worst = divmod(int(d.argmax()), V)
            assert float(d.max()) <= EXACT_TOL, \
                f"{name} request {i}: |{label} - tp1| = {float(d.max()):.3e} at (position, token) {worst}"


def test_bad_shapes_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="does not split into 3 ranks"):
        Engine(**ENGINE_ARGS, tp_size=3)
    with pytest.raises(ValueError, match="each must be 1 or the other"):
        Engine(**ENGINE_ARGS, tp_size=2, ep_size=4)
    with pytest.raises(ValueError, match="n_routed_experts"):
        Engine(**{**ENGINE_ARGS, "config_overrides": {**OVERRIDES, "n_routed_experts": 6}}, tp_size=4, ep_size=4)


def test_split_rules_cover_the_model_once():
    # every rank's parts of every tensor tile the whole tensor exactly once (names, shapes)
    for quantized in (False, True):
        # quantised: a split input dim keeps whole 128-value act-quant blocks (intermediate 512 / 4)
        cfg = DSV4Config.preset("tiny", **OVERRIDES, moe_intermediate_size=512 if quantized else 128)
        whole = {t.name: t for t in model_tensors(cfg, torch.bfloat16, include_mtp=True, quantized=quantized)}
        for tp, ep in [(2, 1), (4, 1), (2, 2), (1, 2)]:
            world = max(tp, ep)
            count: dict[str, int] = {}
            for r in range(world):
                pc = ParallelConfig(tp, ep, r)
                for t in RankShard(pc, Comm(world)).local_tensors(list(whole.values()), cfg.n_routed_experts):
                    count[t.name] = count.get(t.name, 0) + 1
            for name, t in whole.items():
                s = split_of(name, ParallelConfig(tp, ep, 0))
                if ".ffn.experts." in name and ep > 1:
                    continue
                assert s is None or s.parts == world or s.parts == tp, name
            experts = [n for n in whole if ".ffn.experts." in n]
            local_experts = [n for n in count if ".ffn.experts." in n]
            if ep > 1:
                # expert tensors renumbered per rank: each local name held by every rank once
                assert len(local_experts) * ep == len(experts)
                assert all(count[n] == ep for n in local_experts)
            assert all(count[n] == world for n in count if ".ffn.experts." not in n)


def test_quantised_split_keeps_whole_blocks():
    cfg = DSV4Config.preset("tiny", **OVERRIDES)     # routed intermediate 128: 64 per rank
    tensors = model_tensors(cfg, torch.bfloat16, include_mtp=False, quantized=True)
    with pytest.raises(ValueError, match=r"experts\.0\.w2\.weight: .* whole 128-value blocks"):
        RankShard(ParallelConfig(2, 1, 0), Comm(2)).local_tensors(tensors, cfg.n_routed_experts)
    with pytest.raises(ValueError, match=r"shared_experts\.w1\.weight: .* whole 128-value blocks"):
        RankShard(ParallelConfig(2, 2, 0), Comm(2)).local_tensors(tensors, cfg.n_routed_experts)   # FP8 rows


def test_model_runner_shards_through_the_loader():
    # one process, one rank of two: the model holds this rank's shapes and the release slices
    cfg = DSV4Config.preset("tiny", **OVERRIDES)
    full = random_weights(cfg, seed=0, dtype=torch.float64, include_mtp=False)
    shard = RankShard(ParallelConfig(2, 2, 1), Comm(2))
    model = DSV4Model(cfg, dtype=torch.float64, include_mtp=False, shard=shard)
    model.load_stream(shard.shard_stream(full.items(), cfg.n_routed_experts))
    own = dict(model.state_dict())
    H, hd = cfg.num_attention_heads, cfg.head_dim
    assert torch.equal(own["layers.1.attn.wq_b.weight"], full["layers.1.attn.wq_b.weight"][H // 2 * hd:])
    assert torch.equal(own["layers.1.attn.wo_b.weight"],
                       full["layers.1.attn.wo_b.weight"][:, cfg.o_groups // 2 * cfg.o_lora_rank:])
    E = cfg.n_routed_experts
    assert torch.equal(own["layers.2.ffn.experts.0.w2.weight"], full[f"layers.2.ffn.experts.{E // 2}.w2.weight"])
    assert f"layers.2.ffn.experts.{E // 2}.w2.weight" not in own
    assert model.layers[0].attn.n_heads == H // 2 and model.layers[0].ffn.expert_range == (E // 2, E)
    assert torch.equal(own["embed.weight"], full["embed.weight"][V // 2:])


def test_server_flags_reach_the_engine():
    from server import parse_args

    kw = parse_args(["--tp-size", "4", "--ep-size", "4"]).engine_kwargs()
    assert kw["tp_size"] == 4 and kw["ep_size"] == 4
    assert "tp_size" not in parse_args([]).engine_kwargs()


# ---- quantised weights (FP8 linears with block scales, FP4 experts) under the split ---------------

Q_OVERRIDES = {"vocab_size": V, "num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0],
               "moe_intermediate_size": 256}     # 128 per rank: whole act-quant blocks


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    cfg = DSV4Config.preset("tiny", **Q_OVERRIDES)
    path = tmp_path_factory.mktemp("fp8_parallel")
    save_checkpoint(path, cfg, random_weights(cfg, seed=3, include_mtp=False), fmt="fp8")
    return str(path)


@pytest.fixture(scope="module")
def fp8_single(fp8_checkpoint):
    with Engine(**fp8_args(fp8_checkpoint)) as one:
        assert one.runner.model.quantized
        return [(ids, one.scheduler.captured[rid]) for rid, ids in scenario_mixed(one)]


def fp8_args(path: str) -> dict:
    return {k: v for k, v in ENGINE_ARGS.items() if k != "config_overrides"} | {"model_path": path}


def test_a_quantised_linear_runs_its_collective_once():
    # wo_b's all-reduce is a forward hook on an Fp8Linear: run twice, tp ranks scale its output by
    # tp (the quantised engines below diverged so when shared_input replayed the hooks as well)
    lin = Fp8Linear(128, 128)
    lin.weight.copy_(torch.eye(128).to(torch.float8_e4m3fn))
    lin.scale.fill_(1.0)
    calls = []
    lin.register_forward_hook(lambda _m, _i, out: calls.append(out) or out * 2)
    x = torch.ones(3, 128, dtype=torch.float64)
    assert torch.equal(lin(x), 2 * x) and len(calls) == 1


@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2)], ids=["tp2", "tp2-ep2"])
def test_quantised_checkpoint_splits_exactly(fp8_checkpoint, fp8_single, tp, ep):
    # FP8 rows / columns cut with their 128 x 128 scales, FP4 experts cut by intermediate (tp2)
    # or held whole per rank (ep2), activations rounded on the same 1 x 128 blocks as one rank
    # (each rank's K-slice of wo_b / w2 is whole blocks): every e4m3 code is one rank's, and only
    # the order of the all-reduced float64 sums changes, so the bound above holds. (A code decides
    # differently only for a value within ~1e-14 relative of an e4m3 rounding midpoint.)
    with Engine(**fp8_args(fp8_checkpoint), tp_size=tp, ep_size=ep) as eng:
        model = eng.runner.model
        assert model.quantized and model.layers[1].ffn.fp4.w13.shape[0] == 8 // ep
        got = [(ids, eng.scheduler.captured[rid]) for rid, ids in scenario_mixed(eng)]
    assert_same([fp8_single], [got], f"fp8 tp{tp}/ep{ep}")


def test_plan_accounts_one_rank(capsys):
    from memory.plan import main as plan_main

    def whole_and_replicated(cfg):
        tensors = model_tensors(cfg, torch.bfloat16, include_mtp=False, quantized=True)
        replicated = sum(t.nbytes for t in tensors
                         if split_of(t.name, ParallelConfig(8, 8, 0)) is None and ".ffn.experts." not in t.name)
        return tensors, sum(t.nbytes for t in tensors), replicated

    flash = DSV4Config.preset("flash")
    small = flash.replace(num_hidden_layers=3, compress_ratios=(128, 4, 0, 0))
    tensors, whole, replicated = whole_and_replicated(small)
    ranks = [RankShard(ParallelConfig(8, 8, r), Comm(8)).local_nbytes(tensors, small.n_routed_experts)
             for r in range(8)]
    # every split tensor (experts included) tiles once over the 8 ranks, the rest is on every rank
    assert sum(ranks) == whole + 7 * replicated and len(set(ranks)) == 1
    _, whole, replicated = whole_and_replicated(flash)
    assert plan_main(["--preset", "flash", "--gpu-mem-gb", "139", "--tp-size", "8", "--ep-size", "8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    per_rank = (whole - replicated) // 8 + replicated
    assert d["weights_bytes"] == per_rank
    assert abs(d["budget_bytes"] - (139 * 0.88 * 2 ** 30 - per_rank)) < 2 ** 20
    assert plan_main(["--preset", "flash", "--gpu-mem-gb", "139", "--tp-size", "3"]) == 2
    assert "does not split into 3 ranks" in capsys.readouterr().err


def test_a_failed_start_fails_on_every_rank_and_leaves_no_process():
    import multiprocessing

    with pytest.raises(RuntimeError, match=r"parallel engine start failed: rank 0: .*; rank 1: "):
        Engine(**{**ENGINE_ARGS, "max_total_tokens": 1, "max_running_requests": 64}, tp_size=2)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("dsv4-rank")]
