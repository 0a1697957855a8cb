"""DeepSeek-V4 model configuration, read from a Hugging Face ``config.json``.

Keys keep the release's names, so ``DSV4Config.from_json(path)`` reads the real
Flash / Pro files unchanged. Derived values are properties; nothing here imports
torch, so every layer of the project (the memory planner included) can use it.

Presets: ``flash`` and ``pro`` are the released shapes; ``tiny`` is the same
architecture shrunk for CPU tests and the default server (seeded random weights).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ALLOWED_RATIOS = (0, 4, 128)
ROPE_DIM = 64
INDEX_HEAD_DIM = 128  # the Hadamard rotation is 128-point


class ConfigError(ValueError):
    """A config.json value that cannot describe a DeepSeek-V4 model; names the key."""


@dataclass(frozen=True)
class RopeScaling:
    type: str = "yarn"
    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class DSV4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_nextn_predict_layers: int = 1
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    compress_ratios: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4, 0)
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    num_hash_layers: int = 3
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    # "fp8" (weights in 128x128 blocks, FP4 experts) as released, or None for plain tensors.
    quantization: str | None = "fp8"
    expert_dtype: str | None = "fp4"

    def __post_init__(self) -> None:
        self._validate()

    # ---- construction -------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> "DSV4Config":
        """Build from a config.json dict; unknown keys are ignored, missing keys take Flash's values."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {k: v for k, v in d.items() if k in names and k not in ("rope_scaling", "quantization")}
        if "compress_ratios" in kw:
            if not isinstance(kw["compress_ratios"], (list, tuple)):
                raise ConfigError("config key 'compress_ratios' must be a list of ints")
            kw["compress_ratios"] = tuple(int(r) for r in kw["compress_ratios"])
        rs = d.get("rope_scaling")
        if rs:
            rs_names = {f.name for f in dataclasses.fields(RopeScaling)}
            kw["rope_scaling"] = RopeScaling(**{k: v for k, v in rs.items() if k in rs_names})
        qc = d.get("quantization_config")
        kw["quantization"] = qc.get("quant_method") if qc else None
        if "expert_dtype" not in d:
            kw["expert_dtype"] = "fp4" if qc else None
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | Path) -> "DSV4Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path) as f:
            return cls.from_hf_config(json.load(f))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "DSV4Config":
        """``flash``, ``pro`` or ``tiny``; keyword overrides replace single fields."""
        try:
            base = PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
        return dataclasses.replace(base, **overrides) if overrides else base

    def replace(self, **overrides: Any) -> "DSV4Config":
        return dataclasses.replace(self, **overrides)

    def to_hf_config(self) -> dict[str, Any]:
        """The config.json dict (release key names) that reads back to this config."""
        d = dataclasses.asdict(self)
        d.pop("quantization")
        d["compress_ratios"] = list(self.compress_ratios)
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        d["model_type"] = "deepseek_v4"
        if self.quantization == "fp8":
            d["quantization_config"] = {
                "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
            }
        return d

    # ---- derived values -----------------------------------------------------------

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def layer_ratios(self) -> tuple[int, ...]:
        """compress_ratio of each main layer (the MTP layers excluded)."""
        return self.compress_ratios[: self.num_hidden_layers]

    @property
    def mtp_ratios(self) -> tuple[int, ...]:
        return self.compress_ratios[self.num_hidden_layers:]

    @property
    def num_c4_layers(self) -> int:
        return sum(1 for r in self.layer_ratios if r == 4)

    @property
    def num_c128_layers(self) -> int:
        return sum(1 for r in self.layer_ratios if r == 128)

    @property
    def num_swa_only_layers(self) -> int:
        return sum(1 for r in self.layer_ratios if r == 0)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.num_hash_layers

    # ---- validation ---------------------------------------------------------------

    def _validate(self) -> None:
        def need(ok: bool, key: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"config key {key!r}: {msg}")

        n_expected = self.num_hidden_layers + self.num_nextn_predict_layers
        need(len(self.compress_ratios) == n_expected, "compress_ratios",
             f"has {len(self.compress_ratios)} entries, expected num_hidden_layers + "
             f"num_nextn_predict_layers = {n_expected}")
        bad = sorted({r for r in self.compress_ratios if r not in ALLOWED_RATIOS})
        need(not bad, "compress_ratios", f"unknown ratio(s) {bad}; allowed {list(ALLOWED_RATIOS)}")
        need(all(r == 0 for r in self.mtp_ratios), "compress_ratios",
             "the MTP layer entries (the last num_nextn_predict_layers) must be 0")
        need(self.num_key_value_heads == 1, "num_key_value_heads", "DeepSeek-V4 attention is MQA (1)")
        need(self.qk_rope_head_dim == ROPE_DIM, "qk_rope_head_dim", f"must be {ROPE_DIM}")
        need(self.head_dim == 512, "head_dim", "the 584-byte cache row holds exactly 512 dims (448 nope + 64 rope)")
        need(self.index_head_dim == INDEX_HEAD_DIM, "index_head_dim", f"must be {INDEX_HEAD_DIM} (Hadamard size)")
        need(self.num_attention_heads % self.o_groups == 0, "o_groups", "must divide num_attention_heads")
        need(self.sliding_window > 0, "sliding_window", "must be positive")
        need(self.index_topk > 0, "index_topk", "must be positive")
        need(0 < self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             "must be in 1..n_routed_experts")
        need(self.scoring_func == "sqrtsoftplus", "scoring_func", "only 'sqrtsoftplus' is DeepSeek-V4's")
        need(self.hc_mult >= 1, "hc_mult", "must be >= 1")
        need(self.hc_sinkhorn_iters >= 1, "hc_sinkhorn_iters", "must be >= 1")
        need(self.rope_scaling.type == "yarn", "rope_scaling", "only 'yarn' is supported")
        need(self.quantization in (None, "fp8"), "quantization_config", "only fp8 block quantisation is supported")


FLASH = DSV4Config()

PRO = DSV4Config(
    hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
    o_groups=16, index_topk=1024, compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0),
    n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5,
)

# Same architecture, CPU-sized: 4 layers (window-only, CSA, HCA, CSA) + a window-only MTP
# layer; layer 0 is hash-routed; index_topk 16 so top-k selection matters past 64 tokens.
TINY = DSV4Config(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=8, q_lora_rank=128,
    o_groups=2, o_lora_rank=128, index_n_heads=8, index_topk=16,
    compress_ratios=(0, 4, 128, 4, 0), n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=128, num_hash_layers=1, routed_scaling_factor=1.5,
    max_position_embeddings=65536, quantization=None, expert_dtype=None,
)

PRESETS: dict[str, DSV4Config] = {"flash": FLASH, "pro": PRO, "tiny": TINY}
