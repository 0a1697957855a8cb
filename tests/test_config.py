"""DSV4Config: the released config.json files read unchanged, validation names the key, presets."""

import json

import pytest

from dsv4_backend.config import PRESETS, ConfigError, DSV4Config
from tests.conftest import TESTDATA

CONFIGS = TESTDATA / "configs"


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_released_config_reads_to_the_preset(name):
    cfg = DSV4Config.from_json(CONFIGS / f"deepseek-v4-{name}.config.json")
    assert cfg == PRESETS[name]
    raw = json.loads((CONFIGS / f"deepseek-v4-{name}.config.json").read_text())
    assert list(cfg.compress_ratios) == raw["compress_ratios"]
    assert cfg.quantization == "fp8" and cfg.rope_scaling.factor == 16


def test_layer_mix_of_the_released_models():
    flash, pro = PRESETS["flash"], PRESETS["pro"]
    assert (flash.num_swa_only_layers, flash.num_c4_layers, flash.num_c128_layers) == (2, 21, 20)
    assert (pro.num_swa_only_layers, pro.num_c4_layers, pro.num_c128_layers) == (0, 30, 31)
    assert flash.mtp_ratios == (0,) and pro.mtp_ratios == (0,)


def test_hf_round_trip():
    for cfg in PRESETS.values():
        assert DSV4Config.from_hf_config(cfg.to_hf_config()) == cfg


def test_wrong_compress_ratios_length_names_the_key():
    d = PRESETS["flash"].to_hf_config()
    d["compress_ratios"] = d["compress_ratios"][:-1]
    with pytest.raises(ConfigError, match="'compress_ratios'.*43 entries.*expected.*44"):
        DSV4Config.from_hf_config(d)


def test_unknown_ratio_names_the_key_and_value():
    d = PRESETS["flash"].to_hf_config()
    d["compress_ratios"][5] = 16
    with pytest.raises(ConfigError, match=r"'compress_ratios'.*unknown ratio.*\[16\]"):
        DSV4Config.from_hf_config(d)


@pytest.mark.parametrize("key,value", [("o_groups", 7), ("head_dim", 256), ("qk_rope_head_dim", 32),
                                       ("num_key_value_heads", 8), ("scoring_func", "softmax")])
def test_other_invalid_values_name_their_key(key, value):
    d = PRESETS["flash"].to_hf_config()
    d[key] = value
    with pytest.raises(ConfigError, match=f"'{key}'"):
        DSV4Config.from_hf_config(d)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset"):
        DSV4Config.preset("huge")


def test_tiny_preset_has_the_whole_architecture():
    t = PRESETS["tiny"]
    assert t.head_dim == 512 and t.qk_rope_head_dim == 64 and t.sliding_window == 128
    assert {0, 4, 128} <= set(t.layer_ratios)
    assert t.num_hash_layers >= 1 and t.num_hash_layers < t.num_hidden_layers
    assert t.index_topk == 16 and t.hc_mult == 4 and t.vocab_size == 129280
    assert t.n_routed_experts > t.num_experts_per_tok > 1
    assert DSV4Config.preset("tiny", vocab_size=1024).vocab_size == 1024
