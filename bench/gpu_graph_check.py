"""H200 check of decode CUDA graphs (dsv4_backend/cuda_graph.py) on the tiny preset, bf16.

Three runners on the same weights and the same teacher-forced schedule (three requests of 125,
300 and 5 prompt tokens, so the batch of 3 is padded to 4; then decode steps that complete C4
and C128 blocks), with the ring C128 path and with online C128:

- ``eager``: ordinary steps (no graphs);
- ``static``: decode steps through the static tables without a graph (``capture=False``);
- ``graph``: the same static steps captured and replayed.

Two eager runs show whether a step is deterministic (it should be: the MoE sums its k choices
in a fixed order, not with CUDA ``index_add_`` atomics). ``graph`` must equal ``static`` bit for
bit (a replay runs the captured kernels on the refilled buffers: a stale buffer or a host value
frozen into the graph would show); an unpadded graph run (batch 3 captured as 3) must match
``eager`` within 0.1 at the first decode step (identical pools; the bucketed tables change
kernel tilings: bf16 noise), and the padded graph run pick the same argmax at >= 90% of
positions (a flipped FP8 or top-k decision then compounds through the cache). Also times a
decode step of each at batch 3.

    PYTHONUNBUFFERED=1 python3 bench/gpu_graph_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4_backend.config import DSV4Config  # noqa: E402
from dsv4_backend.cuda_graph import DecodeGraphs  # noqa: E402
from dsv4_backend.model_runner import ForwardRequest, ModelRunner  # noqa: E402
from dsv4_backend.weights import random_weights  # noqa: E402

LENS = {"a": 125, "b": 300, "c": 5}
STEPS = 12


def play(runner: ModelRunner, seqs: dict[str, list[int]]) -> tuple[dict[str, torch.Tensor], float]:
    alloc = runner.allocator
    out = {rid: [] for rid in LENS}
    for rid, n in LENS.items():
        alloc.admit(rid)
        assert alloc.extend(rid, n).ok
        [lg] = runner.forward([ForwardRequest(alloc.req_slot(rid), 0, seqs[rid][:n], "last")])
        out[rid].append(lg.float())
    times = []
    for step in range(STEPS):
        reqs = []
        for rid, n in LENS.items():
            p = n + step
            assert alloc.extend(rid, p + 1).ok
            reqs.append(ForwardRequest(alloc.req_slot(rid), p, [seqs[rid][p]], "last"))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = runner.forward(reqs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        for rid, lg in zip(LENS, res):
            out[rid].append(lg.float())
        for rid in LENS:
            alloc.evict_swa(rid)
    steady = sorted(times[2:])[len(times[2:]) // 2]
    return {rid: torch.cat(v) for rid, v in out.items()}, 1e3 * steady


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    cfg = DSV4Config.preset("tiny")
    w = random_weights(cfg, seed=11, dtype=torch.bfloat16, device="cuda", include_mtp=False)
    g = torch.Generator().manual_seed(0)
    seqs = {rid: torch.randint(0, cfg.vocab_size, (n + STEPS,), generator=g).tolist() for rid, n in LENS.items()}
    results, ok = [], True
    for online in (False, True):
        runs = {}
        # eager twice: the run-to-run noise floor (CUDA index_add_ in the MoE accumulates with
        # atomics, in no fixed order); then the static path without and with a graph, padded
        # (max_bs 4: the batch of 3 runs as 4) and unpadded (max_bs 3)
        for name, mode, max_bs in (("eager", None, 0), ("eager2", None, 0), ("static", False, 4),
                                   ("graph", True, 4), ("graph_nopad", True, 3)):
            runner = ModelRunner.build(cfg, dtype=torch.bfloat16, weights=w, backend="triton", device="cuda",
                                       max_total_tokens=4096, max_running_requests=4, online_compress=online,
                                       cuda_graph=False)
            if mode is not None:
                runner.cuda_graphs = DecodeGraphs(runner, max_bs=max_bs, capture=mode)
            logits, ms = play(runner, seqs)
            runs[name] = (logits, ms, runner.cuda_graphs.captures if runner.cuda_graphs else 0)

        def cmp(x: str, y: str) -> dict:
            a, b = runs[x][0], runs[y][0]
            return {"identical": all(torch.equal(a[r], b[r]) for r in LENS),
                    "max_abs": max(float((a[r] - b[r]).abs().max()) for r in LENS),
                    "first_decode_max_abs": max(float((a[r][1] - b[r][1]).abs().max()) for r in LENS),
                    "argmax_agree": sum(int((a[r].argmax(-1) == b[r].argmax(-1)).sum()) for r in LENS)
                    / sum(a[r].shape[0] for r in LENS)}

        row = {"online": online, "eager_vs_eager": cmp("eager2", "eager"), "static_vs_eager": cmp("static", "eager"),
               "graph_vs_static": cmp("graph", "static"), "graph_vs_eager": cmp("graph", "eager"),
               "graph_nopad_vs_eager": cmp("graph_nopad", "eager"),
               "ms_per_step": {k: runs[k][1] for k in runs}, "captures": runs["graph"][2]}
        # a replay computes exactly what the static path computes (same kernels, same shapes; the
        # MoE sums in a fixed order); unpadded graph steps differ from eager ones only by the
        # bucketed tables' tilings (bf16 noise at the first decode step); padded ones may flip
        # an FP8 or top-k decision later, which the cache carries
        passed = (row["graph_vs_static"]["identical"]
                  and row["graph_nopad_vs_eager"]["first_decode_max_abs"] <= 0.1
                  and row["graph_vs_eager"]["argmax_agree"] >= 0.9)
        ok &= passed
        row["pass"] = passed
        results.append(row)
        print(json.dumps(row))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_graph_check.json").write_text(json.dumps(results, indent=2))
    print("GRAPH CHECK", "PASS" if ok else "FAIL")


if __name__ == "__main__":
    main()
