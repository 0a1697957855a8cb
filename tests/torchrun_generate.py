"""Run under torchrun by tests/test_parallel.py: every rank builds ``Engine(**engine_args)``;
rank 0 generates greedily and saves its world size and each request's output ids and captured
logits.

    python -m torch.distributed.run --nproc-per-node 2 tests/torchrun_generate.py ARGS.json OUT.pt

ARGS.json: ``{"engine": {...Engine kwargs}, "input_ids": [[...], ...], "max_new_tokens": [...]}``.
"""

import json
import sys

import torch

from scheduler_hooks.engine import Engine


def main(args_path: str, out_path: str) -> None:
    with open(args_path) as f:
        args = json.load(f)
    eng = Engine(**args["engine"])
    if not eng.is_leader:      # rank > 0: Engine() followed rank 0 until it shut down
        return
    with eng:
        outs = eng.generate(input_ids=args["input_ids"],
                            sampling_params=[{"max_new_tokens": n, "temperature": 0.0} for n in args["max_new_tokens"]])
        got = [(o["output_ids"], eng.captured_logits(o["meta_info"]["id"])) for o in outs]
        eng.check_integrity()     # rank 1's allocator is in rank 0's state
        world = eng.ranks.config.world_size if eng.ranks is not None else 1
    torch.save({"world_size": world, "outputs": got}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
