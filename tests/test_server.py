"""The HTTP server, live: a ``python server.py`` process on 127.0.0.1 (tiny preset, CPU, small pools),
called with the official ``openai`` client and raw httpx.

The tiny model has random weights, so tests check shapes, counts and consistency (greedy stream ==
greedy non-stream, greedy token == top-1 logprob, usage == the tokenizer's own count of the encoded
prompt), not text. Tool-call and reasoning parsing get deterministic text through the response
builder directly.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from dsv4_backend.encoding import DSML, THINK_END, encode_messages, parse_message_from_completion_text
from dsv4_backend.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 512
MAIN_FLAGS = ["--max-running-requests", "16", "--max-queued-requests", "128", "--max-total-tokens", "8192",
              "--context-length", str(CONTEXT), "--chunked-prefill-size", "256"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """A server subprocess; ``url`` once /health answers. ``launcher``: the command that runs
    server.py (torchrun's, for one)."""

    def __init__(self, flags: list[str], launcher: tuple[str, ...] = (sys.executable,)):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([*launcher, "server.py", "--port", str(self.port), "--log-level", "warning",
                                      *flags], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not answer /health in 180 s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-5000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def server():
    s = LiveServer(MAIN_FLAGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def metrics(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments dropped)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def assert_idle_and_empty(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Wait until nothing runs or waits and every pool's use is zero; return the last metrics."""
    deadline = time.time() + timeout
    while True:
        m = metrics(url)
        used = {k: v for k, v in m.items() if k.startswith("dsv4_pool_used{")}
        idle = m["dsv4_num_running_reqs"] == 0 and m["dsv4_num_waiting_reqs"] == 0
        if idle and used and all(v == 0 for v in used.values()):
            return m
        if time.time() > deadline:
            pytest.fail(f"server not idle/empty after {timeout} s: running {m['dsv4_num_running_reqs']}, "
                        f"waiting {m['dsv4_num_waiting_reqs']}, pools {used}")
        time.sleep(0.2)


def chat_prompt_len(tok, messages, **kw) -> int:
    return len(tok.encode(encode_messages(messages, **kw)))


MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


# ---- basic routes ---------------------------------------------------------------------------------


def test_models_and_health(server, client, model):
    assert model == "deepseek-v4-tiny"
    assert httpx.get(server.url + "/health").status_code == 200
    info = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert info["max_model_len"] == CONTEXT
    for path in ("/server_info", "/get_server_info"):     # SGLang's current and older names
        si = httpx.get(server.url + path).json()
        # the flag as given, and the kernel that runs (the CPU keeps the PyTorch path)
        assert si["attention_kernel"] == "auto" and si["engine"]["attention_kernel"] == "torch"
    for path in ("/model_info", "/get_model_info"):
        assert httpx.get(server.url + path).json()["context_length"] == CONTEXT


def test_sglang_tool_routes(server, tok):
    """What sglang.bench_serving calls: POST /flush_cache (with or without the timeout parameter
    it sends) and /model_info's tokenizer_path, the directory of the server's tokenizer.json."""
    for params in ({}, {"timeout": 60.0}):
        r = httpx.post(server.url + "/flush_cache", params=params)
        assert r.status_code == 200 and r.text.startswith("Cache flushed"), r.text
    assert httpx.get(server.url + "/flush_cache").status_code == 405
    path = httpx.get(server.url + "/model_info").json()["tokenizer_path"]
    assert (Path(path) / "tokenizer.json").is_file()
    text = "Name three colours, in Chinese: 红色"
    assert load_tokenizer(path).encode(text) == tok.encode(text)


def test_chat_usage_counts_the_encoded_prompt(client, model, tok):
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=5, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason in ("length", "stop") and isinstance(ch.message.content, str)
    assert r.usage.prompt_tokens == chat_prompt_len(tok, MSGS, thinking_mode="chat")
    if ch.finish_reason == "length":
        assert r.usage.completion_tokens == 5
    else:  # the model drew EOS early
        assert 1 <= r.usage.completion_tokens < 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_shared_system_prompt_is_served_from_the_prefix_cache(server, client, model, tok):
    # a system prompt longer than one 256-token full page: the first request leaves a restore
    # point at 256 inside it, the second (another question) starts there
    system = {"role": "system", "content": " ".join(f"rule {i}: be brief." for i in range(60))}
    first = [system, {"role": "user", "content": "Name a colour."}]
    second = [system, {"role": "user", "content": "Name a fruit."}]
    n = chat_prompt_len(tok, first, thinking_mode="chat")
    assert 256 < n < CONTEXT - 8
    before = metrics(server.url)
    r1 = client.chat.completions.create(model=model, messages=first, max_tokens=2, temperature=0)
    r2 = client.chat.completions.create(model=model, messages=second, max_tokens=2, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.usage.prompt_tokens_details.cached_tokens == 256
    after = metrics(server.url)
    assert after["dsv4_cache_hit_tokens_total"] - before.get("dsv4_cache_hit_tokens_total", 0) == 256
    assert 0 < after["dsv4_cache_hit_rate"] <= 1 and after['dsv4_pool_cached{pool="full"}'] >= 256


def test_disable_radix_cache_flag_reaches_the_engine():
    from server import parse_args
    assert "disable_radix_cache" not in parse_args([]).engine_kwargs()      # on by default
    assert parse_args(["--disable-radix-cache"]).engine_kwargs()["disable_radix_cache"] is True


def test_streamed_chat_equals_non_streamed_and_reports_usage(client, model):
    kw = dict(model=model, messages=MSGS, max_tokens=6, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2  # tokens arrive one by one


def test_chat_n_and_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=4, n=2, seed=7,
                                       logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    for c in r.choices:
        for item in c.logprobs.content:
            assert item.logprob <= 0 and len(item.top_logprobs) == 3
            assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob


def test_completions_token_ids_with_logprobs_greedy_is_top1(client, model):
    rng = random.Random(1)
    ids = [rng.randrange(100, 120000) for _ in range(23)]
    r = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0, logprobs=3)
    ch = r.choices[0]
    assert r.usage.prompt_tokens == len(ids)
    assert len(ch.logprobs.tokens) == len(ch.logprobs.token_logprobs) == r.usage.completion_tokens
    for lp, top in zip(ch.logprobs.token_logprobs, ch.logprobs.top_logprobs):
        assert lp <= 0 and len(top) <= 3
        assert lp == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the most likely token
    # a list of lists: one choice per prompt, usage over both
    r2 = client.completions.create(model=model, prompt=[ids[:5], ids[5:12]], max_tokens=2, temperature=0)
    assert [c.index for c in r2.choices] == [0, 1]
    assert r2.usage.prompt_tokens == 12


def test_completions_echo_and_string_list(client, model, tok):
    r = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=3, echo=True, temperature=0)
    assert r.choices[0].text.startswith("The quick brown fox")
    assert r.usage.prompt_tokens == 1 + len(tok.encode("The quick brown fox"))  # BOS + text
    r = client.completions.create(model=model, prompt=["a b", "c d e"], max_tokens=2, temperature=0,
                                  echo=True, logprobs=1)
    assert len(r.choices) == 2
    # echo + logprobs: prompt tokens first (the very first has no logprob), then the outputs
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == 1 + len(tok.encode("a b")) + 2


def test_generate_native_shape(server):
    r = httpx.post(server.url + "/generate", json={"input_ids": [5, 6, 7, 8], "return_logprob": True,
                                                   "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
                   timeout=60).json()
    assert set(r) == {"text", "output_ids", "meta_info"}
    assert r["meta_info"]["prompt_tokens"] == 4 and r["meta_info"]["completion_tokens"] == len(r["output_ids"])
    assert [e[1] for e in r["meta_info"]["output_token_logprobs"]] == r["output_ids"]
    # curl -d sends a form Content-Type: the JSON body is read anyway
    r = httpx.post(server.url + "/generate", content=json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] == 2  # BOS + "hi"
    # streamed: cumulative SGLang chunks, then [DONE]
    with httpx.stream("POST", server.url + "/generate", timeout=60,
                      json={"input_ids": [5, 6], "stream": True, "sampling_params": {"max_new_tokens": 3,
                                                                                       "ignore_eos": True}}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and [len(c["output_ids"]) for c in chunks] == [1, 2, 3]


# ---- tools and thinking ---------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


def test_tool_request_puts_tools_in_prompt_and_answers_in_shape(client, model, tok):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=4)
    assert r.usage.prompt_tokens == chat_prompt_len(tok, msgs, thinking_mode="chat", tools=TOOLS)
    ch = r.choices[0]
    assert ch.finish_reason in ("length", "stop", "tool_calls")
    assert ch.message.tool_calls is None or all(tc.type == "function" for tc in ch.message.tool_calls)
    # tool_choice "none" leaves the tools out of the prompt
    r = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert r.usage.prompt_tokens == chat_prompt_len(tok, msgs, thinking_mode="chat")


def test_response_builder_parses_dsml_tool_calls_and_reasoning():
    from server import StreamSplitter, build_chat_message

    text = (f"User wants weather.{THINK_END}Let me check.\n\n<{DSML}tool_calls>\n"
            f'<{DSML}invoke name="get_weather">\n<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
            f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>\n</{DSML}invoke>\n'
            f'<{DSML}invoke name="get_weather">\n<{DSML}parameter name="city" string="true">Oslo</{DSML}parameter>\n'
            f"</{DSML}invoke>\n</{DSML}tool_calls>")
    msg, called = build_chat_message(text, thinking=True, tools_enabled=True)
    assert called and msg["reasoning_content"] == "User wants weather." and msg["content"] == "Let me check."
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"city": "Paris", "days": 3},
                                                                                  {"city": "Oslo"}]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in msg["tool_calls"])
    # without tools in the request the DSML stays visible text
    msg, called = build_chat_message(text, thinking=True, tools_enabled=False)
    assert not called and msg["content"].startswith("Let me check.\n\n<" + DSML)
    # streaming the same text in small random pieces: reasoning and content come out whole, no markup leaks
    rng = random.Random(3)
    for _ in range(20):
        sp, reasoning, content, i = StreamSplitter(thinking=True, tools_enabled=True), "", "", 0
        while i < len(text):
            k = rng.randint(1, 7)
            r, c = sp.feed(text[i:i + k])
            reasoning, content, i = reasoning + r, content + c, i + k
        r, c = sp.flush()
        assert (reasoning + r, content + c) == ("User wants weather.", "Let me check.")


def test_thinking_output_goes_to_reasoning_content(server, client, model, tok):
    kw = {"thinking": True}
    r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=6, temperature=0,
                                       extra_body={"chat_template_kwargs": kw})
    prompt = encode_messages(MSGS, thinking_mode="thinking")
    assert prompt.endswith("<think>") and r.usage.prompt_tokens == len(tok.encode(prompt))
    # the same prompt as raw ids through /v1/completions gives the raw text; the chat reply is its parse
    raw = httpx.post(server.url + "/v1/completions", json={"prompt": tok.encode(prompt), "max_tokens": 6,
                                                          "temperature": 0}, timeout=60).json()
    want = parse_message_from_completion_text(raw["choices"][0]["text"], "thinking")
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == want["reasoning_content"]
    assert (msg.content or "") == want["content"]
    # streamed: the reasoning arrives as reasoning_content deltas
    chunks = list(client.chat.completions.create(model=model, messages=MSGS, max_tokens=6, temperature=0,
                                                 stream=True, extra_body={"chat_template_kwargs": kw}))
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                       for c in chunks if c.choices)
    assert streamed == want["reasoning_content"]


# ---- errors -----------------------------------------------------------------------------------------


def _post(url: str, path: str, body) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    return httpx.post(url + path, json=body, timeout=30)


USER = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": -3}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "temperature": -0.1}, "temperature"),
    ("/v1/chat/completions", {"messages": USER, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": USER, "top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": CONTEXT}, "max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": USER, "tools": USER}, "tools"),
    ("/v1/chat/completions", {"messages": USER, "seed": 2 ** 70}, "seed"),  # would otherwise reach the engine
    ("/v1/completions", {"prompt": [1, 2, 129280]}, "prompt"),
    ("/v1/completions", {"prompt": [[5, 6], [-1]]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "abc", "suffix": "xyz"}, "suffix"),
    ("/v1/completions", {"prompt": list(range(10, 10 + CONTEXT))}, "prompt"),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "abc", "frequency_penalty": 9}, "frequency_penalty"),
    ("/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 0}}, None),
    ("/generate", {"text": "a", "sampling_params": {"bogus": 1}}, None),
    ("/generate", {"text": "a", "sampling_params": {"stop": 5}}, None),   # would otherwise reach the engine loop
    ("/generate", {"text": "a", "sampling_params": {"seed": 2 ** 70}}, None),
    ("/v1/chat/completions", b'{"messages": [', None),
    ("/v1/completions", b"not json at all", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS)
def test_invalid_requests_answer_400_in_openai_shape(server, path, body, param):
    r = _post(server.url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


def test_openai_client_sees_bad_request_and_not_found(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=USER, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-unknown", messages=USER, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_server_survives_and_still_serves(client, model):
    r = client.completions.create(model=model, prompt=[7, 8, 9], max_tokens=2)
    assert r.usage.completion_tokens >= 1


# ---- disconnects, overload, load --------------------------------------------------------------------


def test_disconnect_mid_stream_aborts_and_frees_pages(server):
    before = metrics(server.url)["dsv4_generation_tokens_total"]
    max_tokens = CONTEXT - 40
    body = {"prompt": list(range(1000, 1030)), "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got == 3:
                        break  # leave with the request still generating
    m = assert_idle_and_empty(server.url)
    generated = m["dsv4_generation_tokens_total"] - before
    assert 3 <= generated < max_tokens, f"the request ran on after the client left ({generated} tokens)"
    # a non-streamed request whose client gives up (read timeout) is aborted too
    before = m["dsv4_generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.5)
    m = assert_idle_and_empty(server.url)
    generated = m["dsv4_generation_tokens_total"] - before
    assert generated < max_tokens, f"the request ran on after the client left ({generated} tokens)"


def test_overloaded_queue_answers_503_with_retry_after():
    s = LiveServer(["--max-running-requests", "1", "--max-queued-requests", "1", "--max-total-tokens", "2048",
                    "--context-length", "512"])
    try:
        async def go():
            body = {"prompt": list(range(500, 520)), "max_tokens": 6, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(6)])
        rs = asyncio.run(go())
        codes = sorted(r.status_code for r in rs)
        assert 200 in codes and 503 in codes, codes
        for r in rs:
            if r.status_code == 503:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "queue_full"
            else:
                assert r.json()["usage"]["completion_tokens"] == 6
        assert_idle_and_empty(s.url)
    finally:
        s.stop()


def test_64_concurrent_streams_of_mixed_lengths(server):
    rng = random.Random(64)
    jobs = [(rng.sample(range(1000, 100000), rng.randint(4, 160)), rng.randint(1, 8)) for _ in range(64)]

    async def one(c: openai.AsyncOpenAI, ids: list[int], max_tokens: int):
        stream = await c.completions.create(model="deepseek-v4-tiny", prompt=ids, max_tokens=max_tokens,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        texts, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.choices:
                texts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        return usage, finish

    async def run_all():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*[one(c, ids, n) for ids, n in jobs])
        finally:
            await c.close()

    t0 = time.time()
    results = asyncio.run(run_all())
    elapsed = time.time() - t0
    for (ids, max_tokens), (usage, finish) in zip(jobs, results):
        assert usage is not None and finish == "length"
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), max_tokens)
    m = assert_idle_and_empty(server.url)
    assert m["dsv4_time_to_first_token_seconds_count"] >= 64
    print(f"64 streams in {elapsed:.1f} s")


# ---- launch flags ---------------------------------------------------------------------------------


def test_launch_flags_use_sglang_names():
    from server import ServerArgs, parse_args

    a = parse_args([])
    assert (a.preset, a.host, a.port, a.device, a.model_path) == ("tiny", "127.0.0.1", 30000, "cpu", None)
    assert a.engine_kwargs()["dtype"] == "float32" and "max_total_tokens" not in a.engine_kwargs()
    a = parse_args(["--model-path", "/ckpt", "--host", "0.0.0.0", "--port", "8000", "--device", "cuda",
                    "--dtype", "auto", "--served-model-name", "v4", "--max-running-requests", "32",
                    "--mem-fraction-static", "0.8", "--context-length", "4096", "--chunked-prefill-size", "1024",
                    "--log-level", "debug"])
    assert a.model_name == "v4" and a.engine_kwargs() == {
        "model_path": "/ckpt", "preset": "tiny", "device": "cuda", "dtype": "bfloat16", "random_seed": 0,
        "max_running_requests": 32, "mem_fraction_static": 0.8, "context_length": 4096, "chunked_prefill_size": 1024}
    assert parse_args(["--max-total-tokens", "9000"]).engine_kwargs()["max_total_tokens"] == 9000
    over = parse_args(["--preset", "flash", "--json-model-override-args", '{"n_routed_experts": 8}'])
    assert over.engine_kwargs()["config_overrides"] == {"n_routed_experts": 8}
    graphs = parse_args(["--device", "cuda", "--disable-cuda-graph", "--cuda-graph-max-bs", "8"]).engine_kwargs()
    assert graphs["cuda_graph"] is False and graphs["cuda_graph_max_bs"] == 8
    assert "cuda_graph" not in parse_args(["--device", "cuda"]).engine_kwargs()   # the engine's default: on
    for bad in (["--mem-fraction-static", "0.8", "--max-total-tokens", "10"], ["--model-path", "x", "--preset", "pro"],
                ["--preset", "huge"], ["--dtype", "int8"], ["--json-model-override-args", "{bad"],
                ["--json-model-override-args", "[1]"],
                ["--model-path", "x", "--json-model-override-args", '{"n_routed_experts": 8}']):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert isinstance(a, ServerArgs)
