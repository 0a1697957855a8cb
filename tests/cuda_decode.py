"""Shared by the CUDA tests that compare two decodes bit for bit (PDL, side streams): an FP8/FP4
checkpoint of the small test config and an Engine's greedy tokens with their logprobs."""

from __future__ import annotations

from pathlib import Path

import torch

from dsv4_backend.checkpoint import save_checkpoint
from dsv4_backend.weights import random_weights
from scheduler_hooks.engine import Engine
from test_model_runner import CFG


def write_fp8_checkpoint(d: Path) -> Path:
    """The test config's seeded random weights, written as a release-format FP8/FP4 checkpoint in
    small shards."""
    save_checkpoint(d, CFG, random_weights(CFG, seed=3), fmt="fp8", max_shard_bytes=1 << 22)
    return d


def greedy_decode(model_path: Path | None = None) -> tuple[list, list]:
    """Two prompts (250 and 61 tokens) decoded greedily for 14 tokens through a CUDA Engine with
    its decode graphs: (output ids, output logprobs) per prompt. No model_path: the tiny preset's
    random weights made on the device."""
    kw = {"model_path": str(model_path)} if model_path else {"preset": "tiny", "config_overrides": {"vocab_size": 1024},
                                                            "random_weights_on_device": True}
    eng = Engine(device="cuda", dtype="bfloat16", skip_tokenizer_init=True, max_total_tokens=8192,
                 max_running_requests=2, **kw)
    try:
        assert eng.runner.cuda_graphs is not None
        g = torch.Generator().manual_seed(11)
        prompts = [torch.randint(2, CFG.vocab_size, (n,), generator=g).tolist() for n in (250, 61)]
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 14, "temperature": 0.0,
                                                                "ignore_eos": True}, return_logprob=True)
    finally:
        eng.shutdown()
    return [o["output_ids"] for o in outs], [o["meta_info"]["output_token_logprobs"] for o in outs]
