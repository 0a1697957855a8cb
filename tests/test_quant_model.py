"""A quantised checkpoint end to end on the CPU: the engine model kept in FP8 / FP4 against the
float64 reference with activation quantisation, the engine's start-up plan and
``python -m memory.plan --model-path`` counting the weights as loaded.

float64 against float64 (DSV4.md section 4): both sides round the same activations to e4m3, and
the values they round differ only by float64 summation order (~1e-16 relative), which moves an
e4m3 code only when a value lies within that distance of a rounding midpoint (odds ~2^-48 per
element). So the engine must match the reference to the same 1e-9 as the unquantised model
(tests/test_model_runner.py), while leaving activation rounding out moves the logits by O(1).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from dsv4_backend.checkpoint import CheckpointReader, load_checkpoint, save_checkpoint
from dsv4_backend.layers.linear import Fp8Linear, Fp8WeightOnlyLinear
from dsv4_backend.model import DSV4Model
from dsv4_backend.reference import reference_forward
from dsv4_backend.weights import random_weights
from memory.plan import main as plan_main
from scheduler_hooks.engine import Engine
from test_model_runner import CFG, TOL64, Driver, make_runner  # noqa: E402

GiB = 1 << 30


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8")
    save_checkpoint(d, CFG, random_weights(CFG, seed=7), fmt="fp8", max_shard_bytes=1 << 20)
    return d


@pytest.fixture(scope="module")
def seqs():
    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (150, 40)]


def test_quantized_engine_model_equals_the_reference_with_activation_rounding(fp8_dir, seqs):
    q = load_checkpoint(fp8_dir, dtype=torch.float64, include_mtp=False, keep_quantized=True)
    plain = load_checkpoint(fp8_dir, dtype=torch.float64, include_mtp=False, keep_quantized=False).weights
    refs = [reference_forward(CFG, plain, s, act_quant=True) for s in seqs]
    runner = make_runner(q.weights)
    model = runner.model
    assert model.quantized and isinstance(model.layers[0].attn.wq_a, Fp8Linear)
    assert model.layers[0].ffn.experts[0].w1.weight.dtype == torch.uint8
    wo_a = model.layers[0].attn.wo_a        # kept as stored, multiplied as its fold (W8A16)
    assert isinstance(wo_a, Fp8WeightOnlyLinear) and wo_a.weight.dtype == torch.float8_e4m3fn
    d = Driver(runner, seqs)
    d.step([("a", 0, 100), ("b", 1, 30)])                      # chunked prefill, two requests
    d.step([("a", 0, 45), ("b", 1, 1)])                        # crosses a 128-token block
    for _ in range(4):
        d.step([("a", 0, 1), ("b", 1, 1)])                     # batched decode
    d.assert_matches(refs, TOL64)
    # the rounding is not a no-op at this scale: without it the logits move by far more
    unrounded = reference_forward(CFG, plain, seqs[1][:35], act_quant=False)
    assert float((unrounded - refs[1][:35]).abs().max()) > 1e3 * TOL64
    d.finish()


def test_default_model_is_unquantized_and_refuses_nothing_new():
    m = DSV4Model(CFG, torch.bfloat16, include_mtp=False)
    assert not m.quantized and not any(isinstance(x, Fp8Linear) for x in m.modules())
    assert all(t.dtype in (torch.bfloat16, torch.float32, torch.int64) for t in m.state_dict().values())


def _stored_device_bytes(d) -> int:
    """What the server keeps, from the files: e4m3 / e2m1 bytes as stored, FP8 scales decoded to
    fp32 (4 bytes each), wo_a included, MTP not loaded."""
    total = 0
    for f in sorted(d.glob("model-*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                n, dt = math.prod(sl.get_shape()), sl.get_dtype()
                if name.startswith("mtp."):
                    continue
                if dt == "F8_E8M0" and "experts." in name and "shared" not in name:
                    total += n
                elif dt == "F8_E8M0":
                    total += 4 * n
                else:
                    total += n * {"F8_E4M3": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 8}[dt]
    return total


def test_plan_counts_the_checkpoint_as_loaded(fp8_dir, capsys):
    want = _stored_device_bytes(fp8_dir)
    assert CheckpointReader(fp8_dir, dtype=torch.bfloat16, include_mtp=False, keep_quantized=True).nbytes == want
    assert plan_main(["--model-path", str(fp8_dir), "--gpu-mem-gb", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["weights_bytes"] == want
    assert got["budget_bytes"] == int((0.88 - want / GiB) * GiB)
    assert plan_main(["--model-path", str(fp8_dir), "--gpu-mem-gb", "1"]) == 0
    assert f"weights: {want / GiB:.3f} GiB as loaded from" in capsys.readouterr().out
    assert plan_main(["--model-path", str(fp8_dir / "absent"), "--gpu-mem-gb", "1"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_engine_serves_a_quantized_checkpoint_and_plans_with_its_bytes(fp8_dir, seqs, monkeypatch):
    import scheduler_hooks.engine as engine_mod
    monkeypatch.setattr(engine_mod, "_available_bytes", lambda device: 4 * GiB)
    eng = Engine(model_path=str(fp8_dir), skip_tokenizer_init=True, dtype="bfloat16", max_running_requests=2,
                 mem_fraction_static=0.05)
    try:
        assert eng.runner.model.quantized
        assert eng.plan.budget_bytes == int(4 * GiB * 0.05) - _stored_device_bytes(fp8_dir)
        out = eng.generate(input_ids=seqs[1][:20], sampling_params={"max_new_tokens": 3, "temperature": 0.0,
                                                                    "ignore_eos": True})
        assert len(out["output_ids"]) == 3
    finally:
        eng.shutdown()



def test_load_stream_names_what_does_not_fit(fp8_dir):
    reader = CheckpointReader(fp8_dir, dtype=torch.float32, include_mtp=False, keep_quantized=True)
    items = list(reader.stream())

    def fresh():
        return DSV4Model(CFG, torch.float32, include_mtp=False, quantized=True)

    streamed, by_dict = fresh(), fresh()
    streamed.load_stream(iter(items))
    by_dict.load_state_dict(dict(items))
    a, b = streamed.state_dict(), by_dict.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
                                        if a[k].dtype.itemsize == 1)
    assert all(torch.equal(a[k], b[k]) for k in a if a[k].dtype.itemsize > 1)
    # the expert buffers are slices of the stack the MoE runs
    moe = streamed.layers[1].ffn
    assert torch.equal(moe.fp4.w13[3, CFG.moe_intermediate_size:], a["layers.1.ffn.experts.3.w3.weight"])
    with pytest.raises(KeyError, match=r"never came.*layers\.0\.attn\.wq_a\.weight"):
        fresh().load_stream(x for x in items if x[0] != "layers.0.attn.wq_a.weight")
    with pytest.raises(KeyError, match=r"unexpected tensor layers\.9\.attn\.wq_a\.weight"):
        fresh().load_stream(iter(items + [("layers.9.attn.wq_a.weight", items[0][1])]))
    with pytest.raises(KeyError, match=r"duplicate tensor"):
        fresh().load_stream(iter(items + items[:1]))
    name = "layers.1.ffn.experts.3.w2.scale"
    bad = [(n, t[:, :1] if n == name else t) for n, t in items]
    with pytest.raises(ValueError, match=rf"{name} has shape \[256, 1\], the model \[256, 4\]"):
        fresh().load_stream(iter(bad))


def test_missing_kernel_module_falls_back_with_one_warning(caplog):
    from dsv4_backend.layers import linear
    with caplog.at_level("WARNING"):
        assert linear._kernel("no_such_kernel_module", "fn") is None
        assert linear._kernel("no_such_kernel_module", "fn") is None
    assert sum("no_such_kernel_module.fn unavailable" in r.message for r in caplog.records) == 1
