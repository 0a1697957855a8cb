"""The server's speculative flags and metrics, through the official ``openai`` client.

One server (tiny preset, seeded random weights, float32 on the CPU) with
``--speculative-algorithm EAGLE --speculative-num-steps 2 --speculative-eagle-topk 1
--speculative-num-draft-tokens 3``: greedy completions are deterministic and complete, the
accepted-length histogram in ``/metrics`` counts every verify once, and bad flag combinations
stop the launch with a message naming the flag. About 15 s (mostly the server start).
"""

from __future__ import annotations

import openai
import pytest

import server as server_module
from test_server import LiveServer, assert_idle_and_empty, metrics

SPEC_FLAGS = ["--max-running-requests", "4", "--max-total-tokens", "4096", "--context-length", "512",
              "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
              "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"]


@pytest.fixture(scope="module")
def spec_server():
    s = LiveServer(SPEC_FLAGS)
    yield s
    s.stop()


def test_greedy_completions_and_accept_length_metrics(spec_server):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    runs = [client.completions.create(model=model, prompt="The speculative test", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True}) for _ in range(2)]
    assert runs[0].choices[0].text == runs[1].choices[0].text
    assert all(r.usage.completion_tokens == 12 for r in runs)
    m = assert_idle_and_empty(spec_server.url)
    verifies = m["dsv4_spec_verify_steps_total"]
    assert verifies >= 2 * (12 - 1) // 3          # each verify emits at most K + 1 = 3 tokens
    buckets = [m[f'dsv4_spec_accept_length_per_step_bucket{{le="{n}"}}'] for n in ("1", "2", "3")]
    assert buckets == sorted(buckets) and buckets[-1] == verifies == m["dsv4_spec_accept_length_per_step_count"]
    mean = m["dsv4_spec_accept_length_per_step_sum"] / verifies
    assert mean == pytest.approx(m["dsv4_spec_accept_length"]) and 1.0 <= mean <= 3.0
    assert metrics(spec_server.url)["dsv4_generation_tokens_total"] == 24


@pytest.mark.parametrize("argv, field", [
    (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "2"], "speculative_eagle_topk"),
    (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "4"],
     "speculative_num_draft_tokens"),
    (["--speculative-num-steps", "2"], "speculative_num_steps"),
])
def test_bad_flags_stop_the_launch(argv, field, capsys):
    with pytest.raises(SystemExit) as e:
        server_module.parse_args(argv)
    assert e.value.code == 2 and field in capsys.readouterr().err
