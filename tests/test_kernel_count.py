"""bench/kernel_count.py on the CPU: one decode step of the tiny preset, its top-level torch ops
charged to the layer, attention and MoE ranges they ran in (on CUDA the same ranges count kernels)."""

from __future__ import annotations

from bench._bench_common import admit_synthetic, finish_all, tokens_in_flight
from bench.kernel_count import KernelCounter, report, report_text
from scheduler_hooks.engine import Engine


def test_counts_per_layer_kind_are_consistent_and_ordered():
    eng = Engine(preset="tiny", skip_tokenizer_init=True, max_total_tokens=4096, chunked_prefill_size=256,
                 max_running_requests=1, config_overrides={"vocab_size": 1024})
    try:
        rids = admit_synthetic(eng, 300, 1, 4)
        with KernelCounter(eng) as kc:
            outs = kc.step()
        decoded = sum(len(o.delta_ids) for o in outs) + tokens_in_flight(eng)   # read, or in flight (overlap)
        finish_all(eng, rids)
        rep = report(kc, 1)
        # layers of one kind run the same mHC and MoE ops (the first CSA layer's attention of the
        # process also builds the cached Hadamard matrix: this is the engine's first forward)
        csa = [kc.layer(i) for i, r in enumerate(eng.config.layer_ratios) if r == 4]
    finally:
        eng.shutdown()
    assert decoded == 1                                       # the counted step decoded its token
    assert rep["counted"].startswith("top-level torch ops")
    kinds = rep["per_kind"]
    assert {k: d["layers"] for k, d in kinds.items()} == {"window-only": 1, "CSA": 2, "HCA": 1}
    assert len(csa) == 2 and all(csa[0][k] == csa[1][k] for k in ("moe", "mhc_norms"))
    assert csa[0]["attention"] >= csa[1]["attention"] > 0
    # CSA attention adds the indexer to HCA's compressor; window-only layers have neither
    assert kinds["CSA"]["attention"] > kinds["HCA"]["attention"] > kinds["window-only"]["attention"] > 0
    assert all(d["moe"] > 0 and d["mhc_norms"] > 0 for d in kinds.values())
    assert all(d["total"] == d["attention"] + d["moe"] + d["mhc_norms"] for d in kinds.values())
    per_layers = sum(d["total"] * d["layers"] for d in kinds.values())
    assert rep["per_step_total"] == per_layers + sum(rep["outside_layers"].values())
    assert "CSA" in report_text(rep)
