"""Checkpoint formats, writer and loader (dsv4_backend/checkpoint.py).

The expected values are computed here from the format definitions (float64 e4m3 rounding by
ulp, brute-force nearest e2m1 value, python log2 for scales), not with the module's own
helpers. Runs in a few seconds at the tiny preset.
"""

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv4_backend.checkpoint import (
    CheckpointError,
    dequantize_fp4,
    dequantize_fp8_blockwise,
    load_checkpoint,
    quantize_fp4,
    quantize_fp8_blockwise,
    save_checkpoint,
)
from dsv4_backend.config import DSV4Config
from dsv4_backend.layers.quant import dequant_fp8
from dsv4_backend.weights import WeightKind, param_dtype, random_weights, weight_specs

SEED = 3
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


# ---- independent references ---------------------------------------------------------------

def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3fn value (ties to even), x float64 with |x| <= 448."""
    mant, k = torch.frexp(x.abs())                      # |x| = mant * 2^k, mant in [0.5, 1)
    ulp = torch.exp2((k - 4).clamp_min(-9).double())     # 3 mantissa bits; subnormal step 2^-9
    return (torch.round(x / ulp) * ulp).clamp(-448, 448)


def e4m3_ulp(x: torch.Tensor) -> torch.Tensor:
    _, k = torch.frexp(x.abs())
    return torch.exp2((k - 4).clamp_min(-9).double())


def ref_fp8_exponents(w: torch.Tensor) -> list[list[int]]:
    """ceil(log2(amax / 448)) per 128 x 128 block, in python floats."""
    out, inn = w.shape
    rows = []
    for r in range(0, out, 128):
        row = []
        for c in range(0, inn, 128):
            amax = w[r:r + 128, c:c + 128].abs().max().item()
            row.append(math.ceil(math.log2(amax / 448)) if amax > 0 else -126)
        rows.append(row)
    return rows


def ref_fp8_dequant(w: torch.Tensor) -> torch.Tensor:
    """The value an FP8 checkpoint stores for w (float64)."""
    e = torch.tensor(ref_fp8_exponents(w), dtype=torch.float64)
    s = torch.exp2(e).repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    return e4m3_round(w.double() / s) * s


def e2m1_nearest_index(mag: torch.Tensor) -> torch.Tensor:
    """Index into E2M1 of the nearest value to mag (>= 0); ties go to the even index."""
    d = (mag[..., None] - E2M1).abs()
    cand = d == d.min(dim=-1, keepdim=True).values
    even = cand & (torch.arange(8) % 2 == 0)
    return torch.where(even.any(-1), even.int().argmax(-1), cand.int().argmax(-1))


def ref_fp4_dequant(w: torch.Tensor) -> torch.Tensor:
    """The value an FP4 checkpoint stores for w: scale per 32 with amax/scale <= 6, nearest e2m1."""
    out, inn = w.shape
    b = w.double().view(out, inn // 32, 32)
    amax = b.abs().amax(-1)
    s = torch.exp2(torch.ceil(torch.log2(amax / 6)))[..., None]
    x = b / s
    return (torch.sign(x) * E2M1[e2m1_nearest_index(x.abs())] * s).view(out, inn)


def truth(weights: dict, cfg: DSV4Config, fmt: str) -> dict:
    """What loading a checkpoint of ``fmt`` at float32 must give back."""
    kinds = {s.name: s.kind for s in weight_specs(cfg)}
    out = {}
    for name, w in weights.items():
        kind = kinds[name]
        if fmt == "fp32" or kind in (WeightKind.FP32, WeightKind.INT64):
            t = w
        elif fmt == "fp8" and kind is WeightKind.FP8:
            t = ref_fp8_dequant(w)
        elif fmt == "fp8" and kind is WeightKind.FP4:
            t = ref_fp4_dequant(w)
        else:
            t = w.to(torch.bfloat16)
        out[name] = t.to(w.dtype)
    return out


def assert_same_weights(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, name
        assert g.shape == w.shape, name
        if not torch.equal(g, w):
            i = (g.double() - w.double()).abs().argmax().item()
            raise AssertionError(f"{name}: worst element {i}: {g.flatten()[i].item()} vs {w.flatten()[i].item()}")


# ---- fixtures -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cfg():
    return DSV4Config.preset("tiny", vocab_size=1024)


@pytest.fixture(scope="module")
def weights(cfg):
    return random_weights(cfg, SEED)


@pytest.fixture(scope="module")
def expected(cfg, weights):
    """fmt -> truth(weights, cfg, fmt), computed once per format."""
    cache = {}

    def get(fmt):
        if fmt not in cache:
            cache[fmt] = truth(weights, cfg, fmt)
        return cache[fmt]
    return get


@pytest.fixture(scope="module")
def ckpt(cfg, weights, tmp_path_factory):
    """fmt, sharded -> directory of a written checkpoint (written once per module)."""
    root = tmp_path_factory.mktemp("ckpt")
    dirs = {}
    for fmt in ("fp32", "bf16", "fp8"):
        for sharded in (False, True):
            d = root / f"{fmt}_{'sharded' if sharded else 'single'}"
            save_checkpoint(d, cfg, weights, fmt=fmt, max_shard_bytes=(1 << 20) if sharded else None)
            dirs[fmt, sharded] = d
    return dirs


# ---- FP8 blocks -------------------------------------------------------------------------

def test_fp8_blockwise_matches_hand_formula():
    g = torch.Generator().manual_seed(11)
    out, inn = 200, 300                                    # 2 x 3 blocks, the last ones partial
    mags = torch.tensor([[1.0, 2.0 ** -6, 40.0], [0.0, 3e-3, 0.3]])
    w = torch.randn(out, inn, generator=g, dtype=torch.float64)
    w *= mags.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inn]
    w = w.float()
    known = {  # (row, col): (value, e4m3 byte); block (0, 0) has scale 56 / 448 = 2^-3
        (0, 0): (56.0, 0x7E),                  # 448 = 1.75 * 2^8
        (1, 1): (-56.0, 0xFE),
        (2, 2): (0.125, 0x38),                 # 1.0
        (3, 3): (0.125 * 1.0625, 0x38),        # tie between 1.0 and 1.125 -> even (1.0)
        (4, 4): (0.125 * 1.1875, 0x3A),        # tie between 1.125 and 1.25 -> even (1.25)
        (5, 5): (0.125 * 2.0 ** -9, 0x01),     # smallest subnormal
        (6, 6): (0.125 * 1.5 * 2.0 ** -9, 0x02),  # subnormal tie -> even (2^-8)
        (150, 290): (3.0, 0x7C),               # partial edge block: scale 2^-7, 3 / 2^-7 = 384
    }
    for (r, c), (v, _) in known.items():
        w[r, c] = v

    q = quantize_fp8_blockwise(w)
    assert q.weight.dtype == torch.float8_e4m3fn and q.weight.shape == (out, inn)
    assert q.scale.dtype == torch.float8_e8m0fnu and q.scale.shape == (2, 3)
    exps = ref_fp8_exponents(w)
    assert exps[0][0] == -3 and exps[1][2] == -7
    assert (q.scale.view(torch.uint8).int() - 127).tolist() == exps   # all-zero block: floor 2^-126
    scale_f = q.scale.float().double()
    mant, _ = torch.frexp(scale_f)
    assert torch.all(mant == 0.5), "scales must be powers of two"
    b = q.weight.view(torch.uint8)
    for (r, c), (_, byte) in known.items():
        assert b[r, c].item() == byte, (r, c, hex(b[r, c].item()))

    deq = dequantize_fp8_blockwise(q.weight, q.scale, torch.float64)
    want = ref_fp8_dequant(w)
    assert torch.equal(deq, want)
    s = scale_f.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inn]
    err = (deq - w.double()).abs()
    assert torch.all(err <= 0.5 * e4m3_ulp(w.double() / s) * s)
    assert torch.equal(dequantize_fp8_blockwise(q.weight, q.scale, torch.bfloat16), want.to(torch.bfloat16))


# ---- FP4 e2m1 ---------------------------------------------------------------------------

def test_fp4_packs_known_bytes():
    g = torch.Generator().manual_seed(12)
    w = (torch.rand(2, 64, generator=g, dtype=torch.float64) * 2 - 1).float()
    w[0, :6] = torch.tensor([0.5, -1.0, 6.0, 0.0, 1.5, -6.0])    # block (0, 0): scale 1
    w[0, 32:34] = torch.tensor([12.0, -3.0])                       # block (0, 1): scale 2
    w[1, :2] = torch.tensor([-0.125, 1.5])                         # block (1, 0): scale 2^-2
    w[1, 2:32] *= 1.4
    w[1, 32:] *= 1e-3                                              # block (1, 1): 2^ceil(log2(amax/6))
    q = quantize_fp4(w)
    assert q.packed.dtype == torch.int8 and q.packed.shape == (2, 32)
    assert q.scale.dtype == torch.float8_e8m0fnu and q.scale.shape == (2, 2)
    b = q.packed.view(torch.uint8)
    # low nibble = even K index, bit 3 = sign: (0.5, -1) -> 0x1 | 0xA << 4
    assert b[0, :3].tolist() == [0xA1, 0x07, 0xF3]
    assert b[0, 16].item() == 0xB7          # 12/2 = 6 (0x7), -3/2 = -1.5 (0xB)
    assert b[1, 0].item() == 0x79           # -0.5 (0x9), 6 (0x7)
    amax11 = w[1, 32:].abs().max().item()
    assert (q.scale.view(torch.uint8).int() - 127).tolist() == [[0, 1], [-2, math.ceil(math.log2(amax11 / 6))]]

    # every byte against the brute-force nearest e2m1 code
    s = q.scale.float().double().repeat_interleave(32, 1)
    x = w.double() / s
    idx = e2m1_nearest_index(x.abs())
    nib = idx + 8 * ((x < 0) & (idx > 0)).long()
    assert torch.equal(b.long(), nib[:, 0::2] + 16 * nib[:, 1::2])
    assert torch.equal(dequantize_fp4(q.packed, q.scale, torch.float64), ref_fp4_dequant(w))


def test_fp4_round_trip_of_representable_values_is_exact():
    g = torch.Generator().manual_seed(13)
    out, inn = 16, 128
    codes = torch.randint(0, 16, (out, inn), generator=g)
    codes[codes == 8] = 0                                          # -0 is stored as +0
    codes[:, ::32] = torch.where(torch.rand(out, inn // 32, generator=g) < 0.5, 7, 15)  # amax 6 per block
    vals = torch.cat([E2M1, -E2M1])[codes]
    exps = torch.randint(-12, 12, (out, inn // 32), generator=g)
    w = (vals * torch.exp2(exps.double()).repeat_interleave(32, 1)).float()
    q = quantize_fp4(w)
    assert torch.equal(q.scale.view(torch.uint8).long() - 127, exps)
    b = q.packed.view(torch.uint8).long()
    assert torch.equal(b & 0xF, codes[:, 0::2]) and torch.equal(b >> 4, codes[:, 1::2])
    assert torch.equal(dequantize_fp4(q.packed, q.scale, torch.float32), w)


def test_fp4_rounds_to_nearest_even():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want_ties = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    others = [0.3, 0.74, 1.3, 2.6, 4.9, 5.1, 5.99, 0.2]
    want_others = [0.5, 0.5, 1.5, 3.0, 4.0, 6.0, 6.0, 0.0]
    row = [6.0] + ties + [-t for t in ties] + others + [-t for t in others]
    row += [0.0] * (32 - len(row))
    w = torch.tensor([row], dtype=torch.float32)
    d = dequantize_fp4(*quantize_fp4(w), torch.float64)[0].tolist()
    want = [6.0] + want_ties + [-t for t in want_ties] + want_others + [-t for t in want_others]
    assert d[: len(want)] == want

    g = torch.Generator().manual_seed(14)
    w = torch.randn(8, 96, generator=g) * torch.exp2(torch.randint(-5, 5, (8, 1), generator=g).float())
    assert torch.equal(dequantize_fp4(*quantize_fp4(w), torch.float64), ref_fp4_dequant(w))


# ---- writer and loader ------------------------------------------------------------------

@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8"])
def test_round_trip(cfg, ckpt, expected, fmt, sharded):
    d = ckpt[fmt, sharded]
    hf = json.loads((d / "config.json").read_text())
    assert ("quantization_config" in hf) == (fmt == "fp8")
    if sharded:
        assert not (d / "model.safetensors").exists()
        index = json.loads((d / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1
        for f in files:
            in_file = set(load_file(d / f))
            assert in_file == {n for n, v in index["weight_map"].items() if v == f}
    else:
        assert not (d / "model.safetensors.index.json").exists()
        assert (d / "model.safetensors").exists()

    loaded = load_checkpoint(d)
    quantized = fmt == "fp8"
    assert loaded.config == cfg.replace(quantization="fp8" if quantized else None,
                                        expert_dtype="fp4" if quantized else None)
    assert_same_weights(loaded.weights, expected(fmt))
    # own, aligned memory (not views of the file mapping): CPU matmuls give identical bits
    assert all(t.data_ptr() % 64 == 0 for t in loaded.weights.values())


def test_fp8_file_layout(cfg, ckpt):
    d = ckpt["fp8", False]
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        def meta(n):
            s = f.get_slice(n)
            return s.get_dtype(), s.get_shape()
        D, I = cfg.hidden_size, cfg.moe_intermediate_size
        assert meta("layers.0.attn.wq_a.weight") == ("F8_E4M3", [cfg.q_lora_rank, D])
        assert meta("layers.0.attn.wq_a.scale") == ("F8_E8M0", [cfg.q_lora_rank // 128, D // 128])
        assert meta("layers.1.ffn.experts.0.w1.weight") == ("I8", [I, D // 2])
        assert meta("layers.1.ffn.experts.0.w1.scale") == ("F8_E8M0", [I, D // 32])
        assert meta("layers.1.ffn.experts.7.w2.weight") == ("I8", [D, I // 2])
        assert meta("layers.1.ffn.experts.7.w2.scale") == ("F8_E8M0", [D, I // 32])
        assert meta("mtp.0.e_proj.scale") == ("F8_E8M0", [D // 128, D // 128])
        assert meta("embed.weight")[0] == "BF16"
        assert meta("layers.1.attn.compressor.wkv.weight")[0] == "BF16"
        assert meta("layers.1.attn.attn_sink")[0] == "F32"
        assert meta("layers.0.ffn.gate.tid2eid") == ("I64", [cfg.vocab_size, cfg.num_experts_per_tok])
        assert "embed.scale" not in f.keys() and "layers.0.attn.wq_a.weight.scale" not in f.keys()


def test_load_follows_the_dtype_convention(cfg, ckpt, expected):
    for dtype in (torch.float64, torch.bfloat16):
        got = load_checkpoint(ckpt["fp32", True], dtype=dtype).weights
        assert_same_weights(got, random_weights(cfg, SEED, dtype=dtype))
    got = load_checkpoint(ckpt["fp8", True], dtype=torch.bfloat16).weights
    kinds = {s.name: s.kind for s in weight_specs(cfg)}
    want = {n: t.to(param_dtype(n, kinds[n], torch.bfloat16)) for n, t in expected("fp8").items()}
    assert_same_weights(got, want)   # dequantised FP8/FP4 values are exact in bf16


@pytest.mark.parametrize("fmt", ["fp32", "fp8"])
def test_logits_from_loaded_weights_equal_the_truth(cfg, weights, ckpt, expected, fmt):
    from dsv4_backend import reference   # imported here: a broken reference fails only this test
    # 130 tokens: HCA rows exist (>= 128) and CSA top-k (16 of 32 rows) really selects
    ids = torch.randint(0, cfg.vocab_size, (130,), generator=torch.Generator().manual_seed(15))
    want_w = expected(fmt)
    got_w = load_checkpoint(ckpt[fmt, False]).weights
    want = reference.reference_forward(cfg, want_w, ids, dtype=torch.float32, return_hidden=True)
    got = reference.reference_forward(cfg, got_w, ids, dtype=torch.float32, return_hidden=True)
    assert torch.isfinite(want.logits).all()
    assert torch.equal(got.logits, want.logits)
    mtp_want = reference.reference_mtp_forward(cfg, want_w, ids, want.hidden, dtype=torch.float32)
    mtp_got = reference.reference_mtp_forward(cfg, got_w, ids, got.hidden, dtype=torch.float32)
    assert torch.equal(mtp_got, mtp_want)
    if fmt == "fp8":   # the truth here really is the quantised model, not the fp32 one
        for name in ("layers.1.attn.wq_b.weight", "layers.1.ffn.experts.3.w2.weight", "mtp.0.e_proj.weight"):
            assert not torch.equal(want_w[name], weights[name])


def test_checkpoint_without_mtp(cfg, weights, ckpt, tmp_path):
    main_only = {n: t for n, t in weights.items() if not n.startswith("mtp.")}
    save_checkpoint(tmp_path, cfg, main_only, fmt="fp8")
    names = [s.name for s in weight_specs(cfg, include_mtp=False)]
    assert list(load_checkpoint(tmp_path, include_mtp=False).weights) == names
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    assert "mtp.0.e_proj.weight" in str(e.value) and "mtp.0.e_proj.scale" not in str(e.value)
    # a full checkpoint read without MTP skips those tensors silently
    assert list(load_checkpoint(ckpt["fp8", True], include_mtp=False).weights) == names


def test_missing_extra_and_misshaped_tensors_are_all_reported(cfg, weights, tmp_path):
    bad = dict(weights)
    del bad["layers.0.attn_norm.weight"]
    bad["layers.0.attn.extra.weight"] = torch.randn(3, 5)
    bad["layers.2.attn.compressor.ape"] = torch.randn(64, 512)
    save_checkpoint(tmp_path, cfg, bad, fmt="fp32", max_shard_bytes=1 << 21)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    msg = str(e.value)
    assert len(e.value.problems) == 3, msg
    assert "missing: layers.0.attn_norm.weight [256]" in msg
    assert "unexpected: layers.0.attn.extra.weight [3, 5]" in msg
    assert "layers.2.attn.compressor.ape expected [128, 512], found [64, 512]" in msg


def test_scale_problems_are_all_reported(cfg, ckpt, tmp_path):
    save_checkpoint(tmp_path, cfg, {}, fmt="fp8")           # config.json only
    t = load_file(ckpt["fp8", False] / "model.safetensors")
    del t["layers.1.attn.wq_b.scale"]
    t["layers.3.ffn.experts.1.w2.scale"] = t["layers.3.ffn.experts.1.w2.scale"][:, :3].contiguous()
    t["layers.0.ffn.experts.0.w1.weight"] = t["layers.0.ffn.experts.0.w1.weight"][:, :127].contiguous()
    t["embed.scale"] = torch.ones(8, 2).to(torch.float8_e8m0fnu)   # a scale for a bf16 tensor
    t["layers.0.ffn.gate.tid2eid"] = t["layers.0.ffn.gate.tid2eid"].float()
    t["layers.0.attn.wo_b.scale"] = t["layers.0.attn.wo_b.scale"].view(torch.uint8)   # raw bytes, not a scale
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    msg = str(e.value)
    assert len(e.value.problems) == 6, msg
    assert "missing: layers.1.attn.wq_b.scale [32, 1]" in msg
    assert "layers.3.ffn.experts.1.w2.scale expected [256, 4], found [256, 3]" in msg
    assert "layers.0.ffn.experts.0.w1.weight expected [128, 128], found [128, 127]" in msg
    assert "unexpected: embed.scale" in msg
    assert "dtype: layers.0.ffn.gate.tid2eid is stored as F32" in msg
    assert "dtype: layers.0.attn.wo_b.scale is stored as U8" in msg


def test_index_naming_an_absent_tensor_is_reported(cfg, weights, tmp_path):
    save_checkpoint(tmp_path, cfg, weights, fmt="bf16", max_shard_bytes=1 << 22)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"].values()))
    index["weight_map"]["layers.9.attn.wq_a.weight"] = first
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"layers\.9\.attn\.wq_a\.weight is listed in"):
        load_checkpoint(tmp_path)


def test_writer_rejects_unknown_format(cfg, weights, tmp_path):
    with pytest.raises(ValueError, match="fp16"):
        save_checkpoint(tmp_path, cfg, weights, fmt="fp16")


# ---- kept quantised (keep_quantized=True) ---------------------------------------------------

def test_quantized_load_keeps_the_stored_bytes(cfg, weights, ckpt):
    """e4m3 codes, scale exponents and packed nibbles are the bytes the writer stored (wo_a's
    too: its fold, what the release multiplies, is exact from them); everything else loads as
    without quantisation."""
    d = ckpt["fp8", True]
    stored = {}
    for f in sorted(d.glob("model-*.safetensors")):
        stored.update(load_file(f))
    got = load_checkpoint(d, keep_quantized=True, dtype=torch.bfloat16)
    plain = load_checkpoint(d, keep_quantized=False, dtype=torch.bfloat16).weights
    assert got.quantized
    kinds = {s.name: s.kind for s in weight_specs(cfg)}
    for name, kind in kinds.items():
        scale = name.removesuffix(".weight") + ".scale"
        if kind is WeightKind.FP8:
            w, s = got.weights[name], got.weights[scale]
            assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32, name
            assert torch.equal(w.view(torch.uint8), stored[name].view(torch.uint8)), name
            exps = stored[scale].view(torch.uint8).double() - 127
            assert torch.equal(s.double(), torch.exp2(exps)), scale
        elif kind is WeightKind.FP4:
            w, s = got.weights[name], got.weights[scale]
            assert w.dtype == torch.uint8 and s.dtype == torch.uint8, name
            assert torch.equal(w, stored[name].view(torch.uint8)), name
            assert torch.equal(s, stored[scale].view(torch.uint8)), scale
        else:
            assert scale not in got.weights
            assert got.weights[name].dtype == plain[name].dtype and torch.equal(got.weights[name], plain[name]), name
    wo_a = "layers.1.attn.wo_a.weight"
    folded = dequant_fp8(got.weights[wo_a], got.weights[wo_a.replace("weight", "scale")], torch.bfloat16)
    assert torch.equal(folded.double(), ref_fp8_dequant(weights[wo_a]).to(torch.bfloat16).double())
    fp4 = "layers.2.ffn.experts.5.w2.weight"   # the nibbles decode to the writer's rounding
    b = got.weights[fp4]
    codes = torch.stack([b & 15, b >> 4], -1).flatten(-2).long()
    mag = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    s = torch.exp2(got.weights[fp4.replace("weight", "scale")].double() - 127).repeat_interleave(32, 1)
    assert torch.equal(mag * s, ref_fp4_dequant(weights[fp4]))


def test_quantized_load_refuses_unquantized_storage(cfg, weights, ckpt, tmp_path):
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt["bf16", False], keep_quantized=True)
    msg = str(e.value)
    assert "dtype: layers.0.attn.wq_a.weight is stored as BF16; a quantised load keeps it as F8_E4M3" in msg
    assert "dtype: layers.3.ffn.experts.7.w2.weight is stored as BF16" in msg
    assert "dtype: layers.0.attn.wo_a.weight is stored as BF16" in msg
    assert "embed" not in msg and "compressor" not in msg      # those are not kept quantised
    # an FP4 scale must be the release's e8m0 bytes when kept (a float scale is decoded only)
    t = load_file(ckpt["fp8", False] / "model.safetensors")
    name = "layers.1.ffn.experts.2.w3.scale"
    t[name] = t[name].float()
    save_checkpoint(tmp_path, cfg, {}, fmt="fp8")
    save_file(t, str(tmp_path / "model.safetensors"))
    load_checkpoint(tmp_path, keep_quantized=False)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path, keep_quantized=True)
    assert len(e.value.problems) == 1 and f"dtype: {name} is stored as F32" in str(e.value)


def test_default_keeps_quantized_only_on_cuda(ckpt):
    from dsv4_backend.checkpoint import CheckpointReader
    assert not CheckpointReader(ckpt["fp8", False]).quantized
    assert CheckpointReader(ckpt["fp8", False], device="cuda").quantized     # headers only: no GPU used
    assert not CheckpointReader(ckpt["bf16", False], device="cuda").quantized


@pytest.mark.parametrize("keep", [True, False], ids=["quantized", "dequantized"])
def test_loading_streams_one_tensor_at_a_time(ckpt, monkeypatch, keep):
    """Shard by shard: each shard opened once, in order, one more only for a scale the writer
    put in the next shard; at most a weight and its scale read from the files are alive when a
    tensor is handed over (a 160 GB release never sits in host memory)."""
    import weakref

    import dsv4_backend.checkpoint as C

    opened, open_now, alive, worst = [], [0], weakref.WeakSet(), {"open": 0, "alive": 0}

    class Handle:
        def __init__(self, path, **kw):
            self.h = safe_open(path, **kw)

        def __enter__(self):
            opened.append((self.path_name, open_now[0]))    # (shard, handles already open)
            open_now[0] += 1
            self.inner = self.h.__enter__()
            return self

        def __exit__(self, *a):
            open_now[0] -= 1
            return self.h.__exit__(*a)

        def get_tensor(self, name):
            t = self.inner.get_tensor(name)
            alive.add(t)
            return t

    def fake_open(path, **kw):
        h = Handle(path, **kw)
        h.path_name = path.rsplit("/", 1)[-1]
        return h

    reader = C.CheckpointReader(ckpt["fp8", True], keep_quantized=keep)
    monkeypatch.setattr(C, "safe_open", fake_open)
    names = []
    for name, t in reader.stream():
        worst["open"] = max(worst["open"], open_now[0])
        worst["alive"] = max(worst["alive"], len([x for x in alive if x is not t]))
        names.append(name)
        del t
    shards = sorted(p.name for p in ckpt["fp8", True].glob("model-*.safetensors"))
    assert len(shards) > 3
    assert [n for n, depth in opened if depth == 0] == shards       # each shard once, in order
    assert worst["open"] <= 2 and worst["alive"] <= 2, worst
    assert len(names) == len(set(names)) == len(reader.tensor_names())


def test_e8m0_scale_bytes_decode_to_powers_of_two():
    from dsv4_backend.checkpoint import _scale_values
    got = _scale_values(torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu), torch.float64)
    assert got[:255].tolist() == [math.ldexp(1.0, b - 127) for b in range(255)]
    assert math.isnan(got[255].item())
