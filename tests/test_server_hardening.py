"""Server hardening (issue 20): every defect found by a fuzzer and a demanding user, as a test.

A live ``python server.py`` (tiny preset, CPU) with small limits, so each one is reached by a
small request; raw httpx where bytes or headers matter, the ``openai`` client where a client's
view matters. One test runs the app in-process over a real engine to inject a failure into one
request mid-stream; one sends SIGTERM to a server of its own while streams run; one fuzzes the
request bodies that ``/openapi.json`` declares. Whole file: about 60 s.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_server import LiveServer, assert_idle_and_empty, metrics

CONTEXT = 256
LIMITS = {"max_request_bytes": 200_000, "max_json_depth": 16, "max_prompt_chars": 2000, "max_stop_strings": 4,
          "max_top_logprobs": 5, "max_top_k": 1000}
FLAGS = ["--max-running-requests", "4", "--max-queued-requests", "6", "--max-total-tokens", "4096",
         "--context-length", str(CONTEXT), "--chunked-prefill-size", "256",
         *[x for k, v in LIMITS.items() for x in (f"--{k.replace('_', '-')}", str(v))]]
USER = [{"role": "user", "content": "hi"}]
MODEL = "deepseek-v4-tiny"


@pytest.fixture(scope="module")
def server():
    s = LiveServer(FLAGS)
    yield s
    s.stop()


def post(url: str, path: str, body, stream: bool = False) -> httpx.Response:
    """POST ``body`` (an object, or raw bytes); a streamed answer is read to the end."""
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    with httpx.stream("POST", url + path, timeout=60, **kw) as r:
        r.read()
    return r


def sse_events(text: str) -> list:
    """``data:`` payloads of an SSE body, JSON-decoded except ``[DONE]``."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def assert_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---- 1. one request cannot abort the others ------------------------------------------------------


def test_extreme_sampling_values_cannot_abort_the_batch(server):
    prompt = list(range(300, 320))
    body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True}

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            innocent = [c.post("/v1/completions", json={**body, "prompt": [p + k for p in prompt]}) for k in range(3)]
            evil = [c.post("/v1/completions", json={**body, "temperature": 5e-324}),
                    c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "temperature": 5e-324}),
                    c.post("/v1/chat/completions", json={"messages": USER, "repetition_penalty": 1e-320})]
            return await asyncio.gather(*innocent, *evil)

    *innocent, tiny_t, tiny_t_chat, tiny_rp = asyncio.run(go())
    for r in innocent + [tiny_t, tiny_t_chat]:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    for r in innocent:
        assert r.json()["usage"]["completion_tokens"] == 6
    assert_error(tiny_rp, 400, "repetition_penalty")
    # a denormal temperature is greedy: the same tokens as temperature 0 (both run alone)
    greedy = post(server.url, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]["text"]
    tiny = post(server.url, "/v1/completions", {**body, "temperature": 5e-324}).json()["choices"][0]["text"]
    assert tiny == greedy
    assert_idle_and_empty(server.url)


def test_a_request_failing_mid_stream_ends_with_an_error_event_and_others_finish():
    """In-process app over a real engine; the victim's logits row turns NaN at its third token."""
    from dsv4_backend import Engine
    from server import ServerArgs, create_app

    eng = Engine(preset="tiny", max_total_tokens=2048, context_length=CONTEXT, max_running_requests=4)
    eng.start()
    real = eng.runner.forward
    victim_prompt = [77, 78, 79, 80, 81]

    def forward(reqs, *args):
        logits = real(reqs, *args)
        for fr, lg in zip(reqs, logits):
            if fr.prefix_len == len(victim_prompt) + 1 and len(fr.input_ids) == 1 and victim_in(fr):
                with torch.inference_mode():
                    lg[-1] = float("nan")
        return logits

    def victim_in(fr) -> bool:
        rid = next((r.rid for r in eng.scheduler.running if eng.allocator.req_slot(r.rid) == fr.req_slot), None)
        return rid is not None and eng.scheduler.reqs[rid].prompt_ids == victim_prompt

    eng.runner.forward = forward
    app = create_app(eng, ServerArgs(context_length=CONTEXT))

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=120) as c:
            body = {"max_tokens": 8, "ignore_eos": True, "temperature": 0}
            return await asyncio.gather(
                c.post("/v1/completions", json={**body, "prompt": victim_prompt, "stream": True}),
                c.post("/v1/completions", json={**body, "prompt": victim_prompt}),
                c.post("/generate", json={"input_ids": victim_prompt, "stream": True,
                                          "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}),
                *[c.post("/v1/completions", json={**body, "prompt": [5, 6, 7, k]}) for k in range(3)])

    try:
        streamed, plain, native, *innocent = asyncio.run(go())
    finally:
        eng.shutdown()
    events = sse_events(streamed.text)
    assert streamed.status_code == 200 and events[-1] == "[DONE]"
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and "non-finite" in errors[0]["error"]["message"]
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])
                if c["finish_reason"]]
    assert finishes == ["abort"]
    assert_error(plain, 500)
    native_events = sse_events(native.text)
    assert native_events[-1] == "[DONE]" and any("error" in e for e in native_events[:-1])
    assert native_events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    for r in innocent:
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    eng.check_integrity()
    assert all(u["used"] == 0 for u in eng.pool_usage().values())


# ---- 2. refusals come before the first byte, streamed or not ---------------------------------------


REFUSED = [
    ("/generate", {"input_ids": [5, 6], "top_logprobs_num": -1}, "top_logprobs_num"),
    ("/generate", {"input_ids": [5, 6], "top_logprobs_num": 1_000_000}, "top_logprobs_num"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": CONTEXT}, "max_tokens"),
    ("/v1/completions", {"prompt": [5, 6], "top_k": 10 ** 12}, "top_k"),
    ("/v1/completions", {"prompt": [5, 6], "temperature": -1}, "temperature"),
    # more choices than the queue holds could never be admitted: 400, not a 503 to retry (found by the fuzzer)
    ("/v1/completions", {"prompt": [5, 6], "n": 7}, "n"),
]


@pytest.mark.parametrize("path,body,param", REFUSED)
def test_refusals_are_the_same_streamed_or_not(server, path, body, param):
    plain = post(server.url, path, body)
    streamed = post(server.url, path, {**body, "stream": True})
    assert_error(plain, 400, param)
    assert assert_error(streamed, 400, param) == plain.json()["error"]


def test_openai_client_sees_streamed_refusals_as_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2, stream=True, extra_body={"top_k": 10 ** 12})
    assert e.value.body["param"] == "top_k"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=CONTEXT, stream=True)
    assert e.value.body["param"] == "max_tokens"


def test_queue_full_is_a_503_before_the_stream_starts(server):
    long = {"prompt": list(range(900, 920)), "max_tokens": CONTEXT - 30, "ignore_eos": True, "stream": True}

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            stop = asyncio.Event()

            async def filler():         # keeps the 4 slots and the 6 places of the queue taken
                while not stop.is_set():
                    try:
                        r = await c.post("/v1/completions", json=long)
                    except httpx.HTTPError:
                        continue
                    if r.status_code == 503:
                        await asyncio.sleep(0.05)

            async def probe(body):
                """The answer's status line and, unless admitted, its body; ``None`` once admitted.

                A refusal comes at once; an admitted probe is not waited for (a non-streamed one
                would answer only after every request queued ahead of it): leaving closes it."""
                try:
                    async with c.stream("POST", "/v1/completions", json=body, timeout=10) as r:
                        if r.status_code == 200:
                            return None
                        await r.aread()
                        return r
                except httpx.TimeoutException:
                    return None

            fillers = [asyncio.create_task(filler()) for _ in range(12)]
            found = None
            deadline = time.time() + 120
            while time.time() < deadline:
                if metrics(server.url)["dsv4_num_waiting_reqs"] >= 6:
                    both = await asyncio.gather(probe({**long, "max_tokens": 2}),
                                                probe({**long, "max_tokens": 2, "stream": False}))
                    if all(r is not None and r.status_code == 503 for r in both):
                        found = both
                        break
                    # (else a place freed in between and a probe took it: try again)
                await asyncio.sleep(0.1)
            stop.set()
            for t in fillers:
                t.cancel()
            await asyncio.gather(*fillers, return_exceptions=True)
            assert found is not None, "the queue was never seen full with both probes refused"
            return found

    streamed, plain = asyncio.run(go())
    for r in (streamed, plain):
        assert_error(r, 503, code="queue_full")
        assert int(r.headers["retry-after"]) >= 1
    assert streamed.json() == plain.json()
    assert_idle_and_empty(server.url, timeout=60)
    # a batch larger than the queue could never be admitted: 400 naming the field, not a 503 to retry
    assert_error(post(server.url, "/generate", {"input_ids": [[5]] * 7}), 400, "input_ids")


# ---- 3. duplicate rids ------------------------------------------------------------------------------


def test_duplicate_rid_is_refused_and_the_first_is_untouched(server):
    first = {"input_ids": [11, 12, 13], "rid": "dup", "stream": True,
             "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}      # long enough to be running
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/generate", json=first) as r1:
            lines = r1.iter_lines()
            assert next(ln for ln in lines if ln.startswith("data: "))        # the first is running
            second = c.post(server.url + "/generate", json={**first, "stream": False})
            rest = [ln for ln in lines if ln.startswith("data: ")]
    assert_error(second, 400, "rid")
    assert rest[-1] == "data: [DONE]"
    final = json.loads(rest[-2][6:])
    assert final["meta_info"]["id"] == "dup" and len(final["output_ids"]) == 64
    assert final["meta_info"]["finish_reason"]["type"] == "length"


# ---- 4. 400, not 500 --------------------------------------------------------------------------------


def test_lone_surrogates_and_deep_json_are_400(server):
    chat = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    assert_error(post(server.url, "/v1/chat/completions", chat), 400, "messages")
    assert_error(post(server.url, "/generate", b'{"text": "x\\udfff"}'), 400, "text")
    # a correct pair is one character and passes
    ok = post(server.url, "/generate", b'{"text": "\\ud83d\\ude00", "sampling_params": {"max_new_tokens": 1}}')
    assert ok.status_code == 200, ok.text
    deep = b'{"messages": ' + b"[" * 90_000 + b"]" * 90_000 + b"}"
    assert_error(post(server.url, "/v1/chat/completions", deep), 400)

    def nested(depth: int) -> dict:     # a body of exactly ``depth`` levels
        x: dict = {}
        for _ in range(depth - 2):
            x = {"k": x}
        return {"messages": USER, "max_tokens": 1, "chat_template_kwargs": x}
    assert post(server.url, "/v1/chat/completions", nested(LIMITS["max_json_depth"])).status_code == 200
    assert_error(post(server.url, "/v1/chat/completions", nested(LIMITS["max_json_depth"] + 1)), 400,
                 "chat_template_kwargs")


# ---- 5. limits ----------------------------------------------------------------------------------------


LIMITED = [
    ("/generate", {"input_ids": [5], "top_logprobs_num": LIMITS["max_top_logprobs"] + 1}, "top_logprobs_num"),
    ("/v1/completions", {"prompt": [5], "logprobs": LIMITS["max_top_logprobs"] + 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": LIMITS["max_top_logprobs"] + 1},
     "top_logprobs"),
    ("/v1/completions", {"prompt": "x" * (LIMITS["max_prompt_chars"] + 1)}, "prompt"),
    ("/v1/completions", {"prompt": ["x" * 1500, "y" * 501]}, "prompt"),
    ("/generate", {"text": "x" * (LIMITS["max_prompt_chars"] + 1)}, "text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * LIMITS["max_prompt_chars"]}]},
     "messages"),
    ("/v1/completions", {"prompt": [5], "stop": [str(i) for i in range(LIMITS["max_stop_strings"] + 1)]}, "stop"),
    ("/v1/chat/completions", {"messages": USER, "stop_token_ids": list(range(LIMITS["max_stop_strings"] + 1))},
     "stop_token_ids"),
    ("/generate", {"input_ids": [5], "sampling_params": {"stop": list("abcde")}}, "sampling_params.stop"),
    ("/v1/completions", {"prompt": [5], "top_k": LIMITS["max_top_k"] + 1}, "top_k"),
    ("/generate", {"input_ids": [5], "sampling_params": {"top_k": 10 ** 12}}, "sampling_params.top_k"),
]


@pytest.mark.parametrize("path,body,param", LIMITED)
def test_limits_refuse_with_400_naming_the_field(server, path, body, param):
    err = assert_error(post(server.url, path, body), 400, param)
    assert "limit" in err["message"] or "[" in err["message"], err     # it states the bound


def test_limits_admit_what_is_at_the_limit(server):
    at = {"prompt": [5, 6], "max_tokens": 2, "logprobs": LIMITS["max_top_logprobs"], "top_k": LIMITS["max_top_k"],
          "stop": [f"#{i}" for i in range(LIMITS["max_stop_strings"])]}
    r = post(server.url, "/v1/completions", at)
    assert r.status_code == 200, r.text
    assert all(len(t) == LIMITS["max_top_logprobs"] for t in r.json()["choices"][0]["logprobs"]["top_logprobs"])


def test_oversized_bodies_are_413_before_they_are_read(server):
    big = {"prompt": "x" * LIMITS["max_request_bytes"]}
    assert_error(post(server.url, "/v1/completions", big), 413, code="request_too_large")

    def chunked():                      # no Content-Length: refused while reading
        for _ in range(LIMITS["max_request_bytes"] // 10_000 + 2):
            yield b" " * 10_000
    r = httpx.post(server.url + "/v1/completions", content=chunked(), timeout=30)
    assert_error(r, 413, code="request_too_large")


# ---- 7. the schema ------------------------------------------------------------------------------------


def test_openapi_declares_the_bodies_metrics_is_text_405_has_allow(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    comps = spec["components"]["schemas"]
    for path, field in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt"), ("/generate", "text")):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert field in comps[ref.rsplit("/", 1)[1]]["properties"]
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert httpx.get(server.url + "/metrics").headers["content-type"].startswith("text/plain")
    r = httpx.get(server.url + "/v1/chat/completions")
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"


# ---- a fuzzer over the declared request bodies ---------------------------------------------------------


def schema_strategy(schema: dict, comps: dict, name: str = "") -> st.SearchStrategy:
    """Hypothesis values for the JSON-schema subset pydantic emits; small numbers mostly, with
    the edges (0, -1, huge) mixed in, so a body is cheap to serve yet crosses every bound."""
    if "$ref" in schema:
        return schema_strategy(comps[schema["$ref"].rsplit("/", 1)[1]], comps, name)
    if "anyOf" in schema:
        return st.one_of([schema_strategy(s, comps, name) for s in schema["anyOf"]])
    kind = schema.get("type")
    small_int = st.integers(-2, 8) | st.sampled_from([2 ** 31, 10 ** 12, 2 ** 64, -(2 ** 63)])
    words = st.text(max_size=8) | st.sampled_from(["user", "system", "assistant", "tool", MODEL, "\x00", "</think>"])
    if kind == "object" and "properties" in schema:
        props = {k: schema_strategy(v, comps, k) for k, v in schema["properties"].items()}
        required = {k: props.pop(k) for k in schema.get("required", [])}
        return st.fixed_dictionaries(required, optional=props)
    if kind == "object":
        return st.dictionaries(words, words | small_int | st.none(), max_size=3)
    if kind == "array":
        return st.lists(schema_strategy(schema.get("items", {}), comps, name), max_size=4)
    if kind == "integer":
        return small_int
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([0.0, 5e-324, 1e-320, 1e308])
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return words
    if kind == "null":
        return st.none()
    return st.none() | st.booleans() | small_int | words


def bound_output(path: str, body: dict) -> None:
    """An absent output length would default to the context's room (x n): keep examples cheap."""
    if path == "/generate":
        if body.get("sampling_params") is None:
            body["sampling_params"] = {}
        if isinstance(body["sampling_params"], dict):
            body["sampling_params"].setdefault("max_new_tokens", 4)
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4


def test_fuzz_request_bodies_from_the_schema(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    comps = spec["components"]["schemas"]
    routes = {path: schema_strategy(op["post"]["requestBody"]["content"]["application/json"]["schema"], comps)
              for path, op in spec["paths"].items() if "requestBody" in op.get("post", {})}
    assert len(routes) == 3
    seen: dict[int, int] = {}

    @settings(max_examples=50, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(st.sampled_from(sorted(routes)).flatmap(lambda p: st.tuples(st.just(p), routes[p])))
    def one(case):
        path, body = case
        bound_output(path, body)
        r = post(server.url, path, body)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    one()
    assert httpx.get(server.url + "/health").status_code == 200
    assert_idle_and_empty(server.url)
    print("fuzz statuses:", seen)


# ---- 6. SIGTERM under load ------------------------------------------------------------------------------


def test_sigterm_drains_then_ends_the_rest_and_exits_0():
    # the long stream needs thousands of steps: far more than the 1.5 s it is given, on any CPU
    s = LiveServer(["--context-length", "4096", "--max-total-tokens", "8192", "--graceful-shutdown-timeout", "1.5",
                    "--log-level", "info"])
    try:
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)

        async def stream(max_tokens: int, started: asyncio.Event):
            events, finish = [], None
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"prompt": list(range(40, 60)), "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
                async with c.stream("POST", s.url + "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            started.set()
                            events.append(line[6:])
            for e in events:
                if e != "[DONE]":
                    finish = json.loads(e).get("choices", [{}])[0].get("finish_reason") if "choices" in e else finish
            return events, finish

        async def go():
            started = [asyncio.Event() for _ in range(3)]
            tasks = [asyncio.create_task(stream(n, ev)) for n, ev in zip((2, 2, 4000), started)]
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 60)
            s.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(timeout=10) as c:
                refused = await c.post(s.url + "/v1/completions", json={"prompt": [5], "max_tokens": 1})
                health = await c.get(s.url + "/health")
            with pytest.raises(openai.APIStatusError) as e:
                await client.completions.create(model=MODEL, prompt=[5], max_tokens=1, stream=True)
            return await asyncio.gather(*tasks), refused, health, e.value

        (short1, short2, long), refused, health, via_client = asyncio.run(go())
        assert_error(refused, 503, code="shutting_down")
        assert health.status_code == 503 and via_client.status_code == 503
        for events, finish in (short1, short2):
            assert events[-1] == "[DONE]" and finish == "length"
        events, finish = long
        assert events[-1] == "[DONE]" and finish == "abort"
        assert any('"error"' in e and "shutting down" in e for e in events)
        assert s.proc.wait(timeout=30) == 0
        assert "every pool is free" in s.output()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
        s.log.close()
