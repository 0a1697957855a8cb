"""``python -m memory.plan``: the table, --json, --plot, the budget flags and the env flags.

Two runs go through a subprocess (the real entry point, env flags included); the rest call
``main()`` in-process to stay fast.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from memory import env
from memory.configurator import TERM_NAMES
from memory.plan import main
from tests.conftest import ROOT, TESTDATA

FLASH_JSON = TESTDATA / "configs" / "deepseek-v4-flash.config.json"
GiB = 1 << 30


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(env.COMPRESS_STATE_DTYPE, raising=False)
    monkeypatch.delenv(env.USE_ONLINE_COMPRESS, raising=False)


def run_cli(*args, extra_env=None):
    e = {k: v for k, v in os.environ.items() if k not in (env.COMPRESS_STATE_DTYPE, env.USE_ONLINE_COMPRESS)}
    e.update(extra_env or {})
    return subprocess.run([sys.executable, "-m", "memory.plan", *args], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=120)


def run_json(capsys, *args):
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_subprocess_with_env_flag():
    out = run_cli("--preset", "flash", "--budget-gb", "80", "--json",
                  extra_env={env.COMPRESS_STATE_DTYPE: "bf16"})
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["bytes_per_full_token"] == pytest.approx(7033.45, abs=0.01)
    assert d["state_dtype"] == "bfloat16"
    assert set(d["per_token_terms"]) == set(TERM_NAMES)
    assert sum(d["per_token_terms"].values()) == pytest.approx(d["bytes_per_full_token"])
    # bf16 ring: 33152 rows (R=256) x 2*512*2 B x 20 HCA layers
    assert d["fixed_bytes"] == 33152 * 2048 * 20
    full = math.floor((80 * GiB - d["fixed_bytes"]) / d["bytes_per_full_token"] / 256) * 256
    assert d["max_full_tokens"] == full
    assert d["swa_tokens"] == math.floor(full * 0.1 / 128) * 128
    assert d["c4_rows"] == full // 4 and d["c128_rows"] == full // 128 and d["c4_indexer_rows"] == full // 4
    assert d["c4_ring_slots"] == d["swa_tokens"] // 128 * 8 and d["c128_ring_rows"] == 256 * 128
    assert d["requests_fit"] == {"128K": full // (1 << 17), "1M": full // (1 << 20)}


def test_plot_subprocess_writes_png(tmp_path):
    png = tmp_path / "split.png"
    out = run_cli("--preset", "pro", "--budget-gb", "60", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert "10993.84" in out.stdout and "c4_indexer_k" in out.stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_table_lists_terms_pools_and_fits(capsys):
    assert main(["--preset", "flash", "--budget-gb", "100"]) == 0
    text = capsys.readouterr().out
    for name in TERM_NAMES:
        assert name in text
    for needle in ("7705.45", "fixed bytes", "max full tokens", "SWA:", "C4 rows", "C128 rows",
                   "ring slots", "at 128K tokens", "at 1M tokens", "0.1 x 584 x 43"):
        assert needle in text, needle


def test_gpu_memory_budget_and_hisparse(capsys):
    d = run_json(capsys, "--preset", "flash", "--gpu-mem-gb", "140", "--mem-fraction", "0.9",
                 "--weights-gb", "40", "--hisparse-ratio", "2", "--max-running-requests", "64")
    assert d["budget_bytes"] == int((140 * 0.9 - 40) * GiB)
    assert d["bytes_per_full_token"] == pytest.approx(6172.45, abs=0.01)
    assert d["c4_rows"] == d["max_full_tokens"] // 8
    # R=64: 65*128 + 129 = 8449 -> 8576 rows of 4096 B, 20 layers
    assert d["fixed_bytes"] == 8576 * 4096 * 20


def test_speculative_and_online(capsys, monkeypatch):
    d = run_json(capsys, "--preset", "tiny", "--budget-gb", "1", "--speculative", "--max-running-requests", "4")
    assert d["c4_ring_size"] == 16 and d["c128_ring_size"] == 256 and d["speculative_factor"] == 5 / 4
    monkeypatch.setenv(env.USE_ONLINE_COMPRESS, "1")
    d = run_json(capsys, "--preset", "tiny", "--budget-gb", "1", "--max-running-requests", "4")
    assert d["online_compress"] and d["online_state_slots"] == 4 and d["c128_ring_rows"] == 0
    assert d["fixed_bytes"] == (4 + 3) * 3 * 512 * 4 * 1
    # with speculative decoding: 1 + draft tokens states per request (default 4 draft tokens)
    d = run_json(capsys, "--preset", "tiny", "--budget-gb", "1", "--max-running-requests", "4", "--speculative")
    assert d["online_history_size"] == 4 and d["fixed_bytes"] == (4 + 3) * (1 + 4) * 3 * 512 * 4 * 1
    assert d["pool_bytes"]["c128_online"] == (4 * (1 + 4) + 1) * 3 * 512 * 4
    d = run_json(capsys, "--preset", "tiny", "--budget-gb", "1", "--speculative", "--speculative-num-draft-tokens", "6")
    assert d["online_history_size"] == 6
    assert main(["--preset", "tiny", "--budget-gb", "1", "--speculative", "--speculative-num-draft-tokens", "1"]) == 2
    assert "draft_tokens" in capsys.readouterr().err


def test_errors_name_the_fix(capsys):
    assert main(["--preset", "flash", "--budget-gb", "2"]) == 2
    err = capsys.readouterr().err
    assert "--max-running-requests" in err and "--budget-gb" in err
    assert main(["--preset", "flash", "--hisparse-ratio", "0.5"]) == 2
    assert "c4_shrink_factor" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--budget-gb", "10"])  # neither --preset nor --config


def test_config_file_matches_preset(capsys):
    from_file = run_json(capsys, "--config", str(FLASH_JSON), "--budget-gb", "50")
    preset = run_json(capsys, "--preset", "flash", "--budget-gb", "50")
    assert from_file["bytes_per_full_token"] == preset["bytes_per_full_token"]
    assert from_file["max_full_tokens"] == preset["max_full_tokens"]
