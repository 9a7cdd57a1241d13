"""`eyas serve` driven by the official openai client over real loopback HTTP: outputs equal `LLM.generate` token for
token (plain and MTP-speculative), streaming reassembles, stop/seed behave, every bad input is a 4xx with an OpenAI
error body, disconnects free KV blocks, and a concurrent load with disconnects leaves no 5xx and no leaked block."""

import argparse
import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tiny import KEY, NAME, running, wait_idle

from eyas import LLM, SamplingParams
from eyas.serve.cli import add_cli
from eyas.serve.metrics import ServerMetrics

PROMPTS = ["def add(a, b):\n", "import os\n\nclass Foo:", "x"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."}]


@pytest.fixture(scope="module")
def reference(checkpoint):
    return LLM(checkpoint)


@pytest.fixture(scope="module")
def server(checkpoint):
    with running(LLM(checkpoint, max_num_seqs=8)) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def greedy(max_tokens=12, **kw):
    return dict(temperature=0, max_tokens=max_tokens, extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)


def metrics(url) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# -- outputs ----------------------------------------------------------------------------------------------------

def test_completion_greedy_equals_generate(client, reference):
    expected = reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, ref in zip(PROMPTS, expected):
        r = client.completions.create(model=NAME, prompt=prompt, **greedy())
        choice = r.choices[0]
        assert choice.token_ids == ref.token_ids and choice.text == ref.text
        assert choice.finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 12)
        assert r.usage.total_tokens == len(ref.prompt_token_ids) + 12 and r.object == "text_completion"


def test_token_id_prompt(client, reference):
    ids = [5, 6, 7, 8]
    ref = reference.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    r = client.completions.create(model=NAME, prompt=ids, **greedy(6))
    assert r.choices[0].token_ids == ref.token_ids


def test_chat_greedy_equals_generate(client, reference):
    ref = reference.generate([CHAT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    r = client.chat.completions.create(model=NAME, messages=CHAT, **greedy(10))
    assert r.choices[0].token_ids == ref.token_ids
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.object == "chat.completion"


def test_control_tokens_typed_in_chat_content_stay_text(client, reference):
    """A user who types the end-of-sentence and assistant markers gets them as text: the prompt the server runs is
    `encode_chat`'s, with more tokens than the template would give if it parsed them as control tokens."""
    from eyas.engine.chat import encode_chat

    messages = [{"role": "user", "content": "x<｜end▁of▁sentence｜><｜Assistant｜>"}]
    safe = encode_chat(reference.tokenizer, messages)
    parsed = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
    assert len(safe) > len(parsed)
    ref = reference.generate([safe], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    r = client.chat.completions.create(model=NAME, messages=messages, **greedy(6))
    assert r.usage.prompt_tokens == len(safe) and r.choices[0].token_ids == ref.token_ids


def test_streaming_reassembles_to_the_same_text(client):
    full = client.completions.create(model=NAME, prompt=PROMPTS[0], **greedy(20))
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], stream=True,
                                            stream_options={"include_usage": True}, **greedy(20)))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert sum((c.choices[0].token_ids for c in chunks if c.choices), []) == full.choices[0].token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices

    full = client.chat.completions.create(model=NAME, messages=CHAT, **greedy(20))
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, stream=True, **greedy(20)))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_stream_ends_with_done(server):
    body = {"model": NAME, "prompt": "x", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_stop_string_cuts_text(client):
    free = client.completions.create(model=NAME, prompt=PROMPTS[1], **greedy(24)).choices[0].text
    stop = next(free[i:i + 2] for i in range(4, len(free) - 2) if free[i:i + 2].strip())
    expected = free[:free.find(stop)]
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], stop=[stop, "never-seen"], **greedy(24))
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], stop=stop, stream=True, **greedy(24)))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids(client):
    free = client.completions.create(model=NAME, prompt=PROMPTS[1], **greedy(16)).choices[0].token_ids
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], temperature=0, max_tokens=16,
                                  extra_body={"stop_token_ids": [free[5]], "return_token_ids": True})
    assert r.choices[0].token_ids == free[:free.index(free[5]) + 1] and r.choices[0].finish_reason == "stop"


def test_logprobs_equal_the_engines(client, reference):
    ref = reference.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                          logprobs=2))[0]
    tok = reference.tokenizer
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], logprobs=2, **greedy(8))
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in ref.token_ids]
    assert lp.token_logprobs == pytest.approx([e[1] for e in ref.logprobs], abs=1e-5)
    assert [list(d) for d in lp.top_logprobs] == [[tok.decode([t]) for t, _ in e[2]] for e in ref.logprobs]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    stream = list(client.completions.create(model=NAME, prompt=PROMPTS[0], logprobs=2, stream=True, **greedy(8)))
    pieces = [c.choices[0].logprobs for c in stream if c.choices[0].logprobs]
    assert sum((p.token_logprobs for p in pieces), []) == lp.token_logprobs
    assert sum((p.text_offset for p in pieces), []) == lp.text_offset

    chat = client.chat.completions.create(model=NAME, messages=CHAT, logprobs=True, top_logprobs=3, **greedy(6))
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    plain = client.chat.completions.create(model=NAME, messages=CHAT, **greedy(3))
    assert plain.choices[0].logprobs is None
    stream = list(client.chat.completions.create(model=NAME, messages=CHAT, logprobs=True, stream=True,
                                                 **greedy(6)))
    assert [c.logprob for s in stream if s.choices[0].logprobs for c in s.choices[0].logprobs.content] == \
        [c.logprob for c in content]


def test_same_seed_same_text(client):
    def sample(seed):
        return client.completions.create(model=NAME, prompt="x", temperature=1.0, top_p=0.95, seed=seed,
                                         max_tokens=12, extra_body={"ignore_eos": True, "top_k": 50}).choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server[0] + "/health").status_code == 200


def test_the_engine_thread_gets_the_gil_back_within_its_switch_interval_while_serving(checkpoint):
    """While a server runs, a thread holding the GIL yields it to the waiting engine thread after GIL_SWITCH_S, not
    Python's 5 ms; once it stops, the process's interval is back."""
    import sys

    from eyas.serve.engine import GIL_SWITCH_S

    before = sys.getswitchinterval()  # another test's server may have set it
    sys.setswitchinterval(0.005)
    try:
        with running(LLM(checkpoint, max_num_seqs=2)) as (url, _):
            assert httpx.get(url + "/health").status_code == 200
            assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_S)
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)


# -- errors -----------------------------------------------------------------------------------------------------

BAD = [  # (endpoint, body, param the error names, a word of the message)
    ("completions", "{not json", None, "JSON"),
    ("completions", "[1, 2]", None, "object"),
    ("completions", {"model": NAME}, "prompt", "required"),
    ("completions", {"model": NAME, "prompt": "x", "frequency_penalty": 1}, "frequency_penalty", "unknown"),
    ("completions", {"model": NAME, "prompt": "x", "max_tokens": "5"}, "max_tokens", "integer"),
    ("completions", {"model": NAME, "prompt": "x", "temperature": "hot"}, "temperature", "number"),
    ("completions", {"model": NAME, "prompt": "x", "stream": "yes"}, "stream", "boolean"),
    ("completions", {"model": NAME, "prompt": "x", "max_tokens": -3}, "max_tokens", "-3"),
    ("completions", {"model": NAME, "prompt": "x", "max_tokens": 0}, "max_tokens", "positive"),
    ("completions", {"model": NAME, "prompt": "x", "max_tokens": 10**9}, "max_tokens", "context"),
    ("completions", {"model": NAME, "prompt": "x = 1\n" * 200}, "prompt", "context"),
    ("completions", {"model": NAME, "prompt": ""}, "prompt", "empty"),
    ("completions", {"model": NAME, "prompt": [5, 99999]}, "prompt", "vocabulary"),
    ("completions", {"model": NAME, "prompt": [5, "a"]}, "prompt.1", "integer"),
    ("completions", {"model": NAME, "prompt": "x", "seed": 2**70}, "seed", "64-bit"),
    ("completions", {"model": NAME, "prompt": "x", "temperature": -1}, "temperature", "temperature"),
    ("completions", {"model": NAME, "prompt": "x", "top_p": 1.5}, "top_p", "top_p"),
    ("completions", {"model": NAME, "prompt": "x", "top_k": -2}, "top_k", "top_k"),
    ("completions", {"model": NAME, "prompt": "x", "min_p": 2}, "min_p", "min_p"),
    ("completions", {"model": NAME, "prompt": "x", "stop": [""]}, "stop", "stop"),
    ("completions", {"model": NAME, "prompt": "x", "n": 2}, "n", "n=1"),
    ("completions", {"model": "gpt-4", "prompt": "x"}, "model", "gpt-4"),
    ("chat/completions", {"model": NAME, "messages": []}, "messages", "empty"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x = 1\n" * 200}]}, "messages",
     "context"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user"}]}, "messages.0.content", "required"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role",
     "robot"),
    ("chat/completions", {"model": NAME, "messages": CHAT, "response_format": {"type": "xml"}},
     "response_format", "xml"),
    ("chat/completions", {"model": NAME, "messages": CHAT, "response_format": {"type": "json_schema"}},
     "response_format", "schema"),
    ("chat/completions", {"model": NAME, "messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}}},
     "response_format", "objectx"),
    ("completions", {"model": NAME, "prompt": "x", "guided_regex": "[a-"}, "guided_regex", "regex"),
    ("chat/completions", {"model": NAME, "messages": CHAT, "max_completion_tokens": -1}, "max_completion_tokens",
     "positive"),
    ("completions", {"model": NAME, "prompt": "x", "logprobs": 21}, "logprobs", "0..20"),
    ("completions", {"model": NAME, "prompt": "x", "logprobs": True}, "logprobs", "integer"),
    ("chat/completions", {"model": NAME, "messages": CHAT, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ("chat/completions", {"model": NAME, "messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs",
     "0..20"),
    ("completions", {"model": NAME, "prompt": "x", "stop_token_ids": [-4]}, "stop_token_ids", "token ids"),
    ("completions", {"model": NAME, "prompt": "x", "guided_regex": "[^\\s\\S]"}, "guided_regex", "match no output"),
    ("chat/completions", {"model": NAME, "messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {"type": "string"}}}}},
     "response_format", "uses not, which"),
    ("completions", {"model": NAME, "prompt": "x", "stop": [f"s{i}" for i in range(65)]}, "stop", "at most 64"),
]


@pytest.mark.parametrize("endpoint,body,param,word", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_request_is_a_4xx_naming_the_problem(server, endpoint, body, param, word):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server[0]}/v1/{endpoint}", content=content,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and word in error["message"], error


def test_unknown_route_and_method_have_error_bodies(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    for method, path, status in (("GET", "/v1/completions", 405), ("POST", "/v1/embeddings", 404)):
        r = httpx.request(method, server[0] + path, headers=headers)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_bad_request_through_the_client(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=NAME, prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


def test_api_key(server):
    url = server[0]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=NAME, prompt="x", max_tokens=2)
    assert httpx.get(url + "/health").status_code == 200  # probes need no key


# -- structured output ------------------------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


def test_json_schema_response_format(client):
    import jsonschema

    r = client.chat.completions.create(
        model=NAME, messages=CHAT, temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.completions.create(model=NAME, prompt="x", max_tokens=16, extra_body={"guided_regex": "[0-9]{3}"})
    assert r.choices[0].text.isdigit() and len(r.choices[0].text) == 3
    with pytest.raises(openai.BadRequestError, match="objectx"):
        client.chat.completions.create(model=NAME, messages=CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}})


# -- speculative ------------------------------------------------------------------------------------------------

def test_mtp_speculative_greedy_equals_generate(checkpoint, reference):
    expected = reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    llm = LLM(checkpoint, speculative_method="mtp", num_speculative_tokens=2)
    with running(llm) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        for prompt, ref in zip(PROMPTS, expected):
            r = client.completions.create(model=NAME, prompt=prompt, **greedy(16))
            assert r.choices[0].token_ids == ref.token_ids
            chunks = list(client.completions.create(model=NAME, prompt=prompt, stream=True, **greedy(16)))
            assert "".join(c.choices[0].text for c in chunks) == ref.text
        m = metrics(url)
    spec = llm.scheduler.metrics
    assert spec.num_verify_steps > 0
    for prefix in ("eyas", "vllm"):
        assert m[(f"{prefix}:spec_decode_num_drafts_total", ())] == spec.num_verify_steps
        assert m[(f"{prefix}:spec_decode_num_draft_tokens_total", ())] == spec.num_drafted
        assert m[(f"{prefix}:spec_decode_num_accepted_tokens_total", ())] == spec.num_accepted
        per_pos = [m[(f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(k)),))]
                   for k in range(2)]
        assert per_pos == (spec.accepted_per_position + [0, 0])[:2]


# -- cancellation and load ---------------------------------------------------------------------------------------

def test_disconnect_frees_kv_blocks_at_once(checkpoint):
    llm = LLM(checkpoint)
    with running(llm) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        stream = client.completions.create(model=NAME, prompt=PROMPTS[0], stream=True, **greedy(200))
        for i, _ in enumerate(stream):
            if i == 2:
                break
        assert llm.allocator.num_used > 0
        stream.close()
        start = time.time()
        wait_idle(llm, timeout=60)
        print(f"blocks freed {(time.time() - start) * 1000:.0f} ms after the disconnect")
        m = metrics(url)
    assert m[("eyas:request_success_total", (("finished_reason", "abort"),))] == 1
    # freed at the disconnect, not when the 200 tokens were done: counted in tokens, so a busy machine cannot fail it
    assert m[("eyas:generation_tokens_total", ())] < 100 and llm.allocator.num_used == 0


def test_disconnect_while_waiting_for_a_full_response(checkpoint):
    llm = LLM(checkpoint)
    step = llm.step
    llm.step = lambda: (time.sleep(0.01), step())[1]  # 200 tokens take 2 s; the client gives up after 0.3 s
    with running(llm) as (url, _):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", timeout=0.3, headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": NAME, "prompt": "x", "max_tokens": 200, "ignore_eos": True})
        wait_idle(llm, timeout=60)
        m = metrics(url)
    assert m[("eyas:request_success_total", (("finished_reason", "abort"),))] == 1
    assert m[("eyas:generation_tokens_total", ())] < 150  # stopped at the disconnect, long before the 200th


def test_client_that_gives_up_before_its_first_token_costs_no_prefill(checkpoint, caplog):
    """While a step runs, a client sends a request and gives up 50 ms later: its sequence is added and aborted
    between the same two steps, so the engine never computes a token of it, and the access log has one line for
    it, marked, without a traceback."""
    llm = LLM(checkpoint)
    step, schedule, stepping, computed = llm.step, llm.scheduler.schedule, threading.Event(), set()

    def slow_step():
        stepping.set()
        time.sleep(0.4)
        return step()

    def recording_schedule():
        batch = schedule()
        computed.update(seq.seq_id for seq in batch.seqs)
        return batch

    llm.step, llm.scheduler.schedule = slow_step, recording_schedule
    with caplog.at_level("INFO", logger="eyas.access"), running(llm) as (url, _):
        auth = {"Authorization": f"Bearer {KEY}"}
        body = {"model": NAME, "prompt": "x", "max_tokens": 6, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)  # the stream's first token is out: every step from now on sleeps first
            stepping.clear()
            assert stepping.wait(60)
            for stream in (False, True):
                with pytest.raises(httpx.ReadTimeout):
                    with httpx.stream("POST", url + "/v1/completions", headers=auth, timeout=0.05,
                                      json={**body, "max_tokens": 50, "stream": stream}) as gone:
                        gone.read()
            list(lines)
        wait_idle(llm, timeout=60)
        m = metrics(url)
        deadline = time.time() + 60
        while len([r for r in caplog.records if r.name == "eyas.access" and "completions" in r.getMessage()]) < 3:
            assert time.time() < deadline
            time.sleep(0.01)
    assert m[("eyas:request_success_total", (("finished_reason", "abort"),))] == 2
    assert m[("eyas:generation_tokens_total", ())] == 6  # the stream's; none for the two that gave up
    assert len(computed) == 1  # only the stream's sequence was ever scheduled
    access = [r.getMessage() for r in caplog.records if r.name == "eyas.access" and "completions" in r.getMessage()]
    assert sum(line.endswith("client disconnected") for line in access) == 2, access
    assert not [r for r in caplog.records if r.exc_info], "a disconnect logged a traceback"


def test_client_that_leaves_while_sending_its_body_is_one_log_line(server, caplog):
    """A client announces a 1,000-byte body, sends 10 bytes and closes: a 499 in the access log, no traceback from
    the ASGI server (it was a 500 and "Exception in ASGI application")."""
    import logging

    errors: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = errors.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    host, port = server[0].removeprefix("http://").split(":")
    try:
        with caplog.at_level("INFO", logger="eyas.access"):
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
                time.sleep(0.2)
            deadline = time.time() + 5
            while not [r for r in caplog.records if r.name == "eyas.access" and " 499 " in r.getMessage()]:
                assert time.time() < deadline, "no access line for the client that left"
                time.sleep(0.01)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    line = next(r.getMessage() for r in caplog.records if r.name == "eyas.access" and " 499 " in r.getMessage())
    assert line.endswith("client disconnected")
    assert not errors, [r.getMessage() for r in errors]


def test_concurrent_streams_with_disconnects(checkpoint):
    # 16 blocks of 16 tokens cannot hold 8 sequences of 40-120 tokens: some wait or are preempted, none refused
    llm = LLM(checkpoint, max_num_seqs=8, num_blocks=16)
    num_clients, statuses, done, dropped = 16, [], [], []

    async def one(http: httpx.AsyncClient, i: int) -> None:
        disconnect = i % 3 == 0
        body = {"model": NAME, "prompt": "word " * (1 + 12 * (i % 5)), "stream": True, "temperature": 0.8,
                "seed": i, "max_tokens": 120 if disconnect else 30 + 10 * (i % 4), "ignore_eos": True,
                "return_token_ids": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            statuses.append(r.status_code)
            events = []
            async for line in r.aiter_lines():
                if line:
                    events.append(line)
                if disconnect and len(events) == 3:
                    dropped.append(i)
                    return  # leaving the block closes the connection mid-stream
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert all(c.get("object") == "text_completion" and len(c["choices"]) == 1 for c in chunks), chunks
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == body["max_tokens"]
        assert len(set(c["id"] for c in chunks)) == 1
        done.append(i)

    async def load(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=30) as http:
            await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(num_clients))), timeout=40)

    with running(llm) as (url, _):
        asyncio.run(load(url))
        wait_idle(llm)
        m = metrics(url)
    assert statuses == [200] * num_clients
    assert len(dropped) == 6 and len(done) == 10
    assert llm.allocator.num_used == 0 and llm.scheduler.num_preemptions > 0
    finished = {reason: m[("eyas:request_success_total", (("finished_reason", reason),))]
                for reason in ("stop", "length", "abort")}
    assert finished == {"stop": 0, "length": 10, "abort": 6}
    assert m[("eyas:time_to_first_token_seconds_count", ())] >= 10
    assert m[("eyas:num_requests_running", ())] == 0 and m[("eyas:kv_cache_blocks_used", ())] == 0


def test_metrics_count_requests(server, client):
    before = metrics(server[0])
    client.completions.create(model=NAME, prompt="x", **greedy(3))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x", top_p=7)
    after = metrics(server[0])
    length = ("eyas:request_success_total", (("finished_reason", "length"),))
    rejected = ("eyas:request_rejected_total", (("status", "400"),))
    assert after[length] == before[length] + 1
    assert after[rejected] == before.get(rejected, 0) + 1
    assert after[("eyas:generation_tokens_total", ())] == before[("eyas:generation_tokens_total", ())] + 3


# The hand-written exposition's answer to the scrape in test_metrics_are_the_hand_written_ones_for_the_same_traffic,
# recorded from it (its HELP and TYPE lines left out): the samples prometheus_client must reproduce.
BEFORE = """\
eyas:request_success_total{model_name="tiny",finished_reason="abort"} 0
eyas:request_success_total{model_name="tiny",finished_reason="length"} 3
eyas:request_success_total{model_name="tiny",finished_reason="stop"} 1
eyas:request_rejected_total{model_name="tiny",status="400"} 2
eyas:request_rejected_total{model_name="tiny",status="401"} 1
eyas:prompt_tokens_total{model_name="tiny"} 40
eyas:generation_tokens_total{model_name="tiny"} 20
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="0.001"} 0
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="0.005"} 0
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="0.01"} 3
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="0.02"} 4
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="0.04"} 4
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="0.06"} 4
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="0.08"} 4
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="0.1"} 4
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="0.25"} 4
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="0.5"} 4
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="0.75"} 4
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="1.0"} 4
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="2.5"} 4
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="5.0"} 4
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="7.5"} 4
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="10.0"} 4
eyas:time_to_first_token_seconds_bucket{model_name="tiny",le="+Inf"} 4
eyas:time_to_first_token_seconds_count{model_name="tiny"} 4
eyas:time_to_first_token_seconds_sum{model_name="tiny"} 0.039999999999999994
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="0.001"} 0
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="0.0025"} 0
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="0.005"} 1
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="0.01"} 3
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="0.025"} 3
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="0.05"} 3
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="0.075"} 3
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="0.1"} 3
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="0.15"} 3
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="0.2"} 3
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="0.3"} 3
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="0.4"} 3
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="0.5"} 3
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="0.75"} 3
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="1.0"} 3
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="2.5"} 3
eyas:time_per_output_token_seconds_bucket{model_name="tiny",le="+Inf"} 3
eyas:time_per_output_token_seconds_count{model_name="tiny"} 3
eyas:time_per_output_token_seconds_sum{model_name="tiny"} 0.019
eyas:num_requests_running{model_name="tiny"} 0
eyas:num_requests_waiting{model_name="tiny"} 0
eyas:kv_cache_blocks_used{model_name="tiny"} 0
eyas:kv_cache_blocks_total{model_name="tiny"} 256
eyas:num_preemptions_total{model_name="tiny"} 3
eyas:spec_decode_num_drafts_total{model_name="tiny"} 13
eyas:spec_decode_num_draft_tokens_total{model_name="tiny"} 23
eyas:spec_decode_num_accepted_tokens_total{model_name="tiny"} 7
eyas:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"} 5
eyas:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="1"} 2
vllm:spec_decode_num_drafts_total{model_name="tiny"} 13
vllm:spec_decode_num_draft_tokens_total{model_name="tiny"} 23
vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"} 7
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"} 5
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="1"} 2
eyas:spec_decode_num_verified_tokens_per_pos_total{model_name="tiny",position="0"} 13
eyas:spec_decode_num_verified_tokens_per_pos_total{model_name="tiny",position="1"} 10
"""


def fixed_traffic(url: str) -> None:
    """Requests whose counts are the same on every run, one at a time: plain, streamed and chat completions, one cut
    by a stop token, and three refusals."""
    auth = {"Authorization": f"Bearer {KEY}"}

    def post(path: str, **body) -> httpx.Response:
        return httpx.post(url + path, json={"model": NAME, "temperature": 0, **body}, headers=auth, timeout=60)

    first = post("/v1/completions", prompt=PROMPTS[0], max_tokens=8, ignore_eos=True, return_token_ids=True)
    stop = first.json()["choices"][0]["token_ids"][:1]  # the first token again: it stops after 1
    assert post("/v1/completions", prompt=PROMPTS[0], max_tokens=8, stop_token_ids=stop).status_code == 200
    assert post("/v1/completions", prompt=PROMPTS[1], max_tokens=6, ignore_eos=True, stream=True).status_code == 200
    assert post("/v1/chat/completions", messages=CHAT, max_tokens=5, ignore_eos=True).status_code == 200
    assert post("/v1/completions", prompt="x", top_p=7).status_code == 400
    assert post("/v1/completions", prompt="x", max_tokens=-1).status_code == 400
    assert httpx.get(url + "/v1/models").status_code == 401


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(name, labels) -> value of every sample, model_name included, but prometheus_client's _created stamps."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def test_metrics_are_the_hand_written_ones_for_the_same_traffic(checkpoint):
    """The same sample names, label sets and values as the hand-written exposition for the same requests; only the
    text differs (1.0 for 1, labels sorted, counters' HELP and TYPE lines naming NAME_total) and the instruments add
    _created stamps. Durations are wall-clock, so both scrapes had them made from token counts instead."""
    llm = LLM(checkpoint, speculative_method="mtp", num_speculative_tokens=2)
    with running(llm) as (url, app):
        finished = app.state.metrics.finished
        app.state.metrics.finished = lambda reason, num_prompt, num_generated, ttft, tpot: finished(
            reason, num_prompt, num_generated, None if ttft is None else num_prompt / 1000,
            None if tpot is None else num_generated / 1000)
        fixed_traffic(url)
        wait_idle(llm)
        # the random MTP layer never has a draft accepted: distinct counts show a position or a name mixed up
        spec = llm.scheduler.metrics
        spec.num_accepted, spec.accepted_per_position = 7, [5, 2]
        llm.scheduler.num_preemptions = 3
        after = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert samples(after) == samples(BEFORE)


def test_metrics_parse_with_their_types_in_a_registry_per_server(checkpoint):
    """prometheus_client's parser reads each family with its type (the hand-written TYPE lines named counters
    without the _total their samples carry, so it read those as untyped); each server counts in its own registry,
    none in the global one, and a model name with quotes, a backslash and a newline comes back as it was."""
    llm = LLM(checkpoint, speculative_method="mtp", num_speculative_tokens=2)
    with running(llm) as (url, _):
        r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST
    types = {family.name: family.type for family in text_string_to_metric_families(r.text)}
    counters = ["eyas:request_success", "eyas:request_rejected", "eyas:prompt_tokens", "eyas:generation_tokens",
                "eyas:num_preemptions"] + [f"{prefix}:spec_decode_num_{name}" for prefix in ("eyas", "vllm")
                                           for name in ("drafts", "draft_tokens", "accepted_tokens",
                                                        "accepted_tokens_per_pos")] + [
                    "eyas:spec_decode_num_verified_tokens_per_pos"]
    gauges = ["eyas:num_requests_running", "eyas:num_requests_waiting", "eyas:kv_cache_blocks_used",
              "eyas:kv_cache_blocks_total", "eyas:request_success_created"]
    histograms = ["eyas:time_to_first_token_seconds", "eyas:time_per_output_token_seconds"]
    assert {name: types.get(name) for name in counters + gauges + histograms} == \
        {**dict.fromkeys(counters, "counter"), **dict.fromkeys(gauges, "gauge"),
         **dict.fromkeys(histograms, "histogram")}

    def rejections(metrics: ServerMetrics) -> list[tuple[dict, float]]:
        text = generate_latest(metrics.registry).decode()
        return [(s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "eyas:request_rejected_total"]

    odd = 'a "quoted" \\ name\nof two lines'
    one, other = ServerMetrics(odd, llm), ServerMetrics(odd, llm)  # the same names: no clash
    one.rejected(429)
    assert rejections(one) == [({"model_name": odd, "status": "429"}, 1.0)] and rejections(other) == []
    assert not [family.name for family in REGISTRY.collect() if family.name.startswith(("eyas:", "vllm:"))]


def test_cli_serve_arguments():
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["serve", "--port", "9001", "--api-key", "k", "--speculative-method", "mtp",
                                      "--served-model-name", "m", "--max-num-seqs", "4"])
    assert (args.port, args.api_key, args.speculative_method, args.served_model_name, args.max_num_seqs) == \
        (9001, "k", "mtp", "m", 4)


def test_an_empty_or_spaced_api_key_is_refused(capsys):
    """`--api-key ""` would accept 'Authorization: Bearer' with nothing after it while the banner says no key is
    needed; a key with spaces could never match. Both are refused by the flag and by build_app."""
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    for key in ("", "   ", "two words", " k"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--api-key", key])
        assert "--api-key" in capsys.readouterr().err
    from eyas.serve.app import build_app

    for key in ("", " "):
        with pytest.raises(ValueError, match="api_key"):
            build_app(None, NAME, api_key=key)


def test_access_log_line_per_request_and_banner(server, client, caplog):
    from eyas.serve.app import banner

    def ours():  # a line is written once its response has ended, so an earlier test's may still land here
        return [r.getMessage() for r in caplog.records if r.name == "eyas.access"
                and ("/v1/completions" in r.getMessage() or "/v1/nope" in r.getMessage())]

    with caplog.at_level("INFO", logger="eyas.access"):
        client.completions.create(model=NAME, prompt="x", **greedy(max_tokens=3))
        list(client.completions.create(model=NAME, prompt="x", stream=True, **greedy(max_tokens=2)))
        httpx.get(server[0] + "/v1/nope")
        deadline = time.time() + 5
        while len(ours()) < 3 and time.time() < deadline:
            time.sleep(0.01)
    lines = sorted(ours())
    assert len(lines) == 3, lines
    assert '"GET /v1/nope" 404' in lines[0] and lines[0].endswith("s")
    assert '"POST /v1/completions" 200' in lines[1] and "+2 tokens" in lines[1]  # the stream: logged at its end
    assert '"POST /v1/completions" 200' in lines[2] and "+3 tokens" in lines[2]
    llm = server[1].state.engine.llm
    args = argparse.Namespace(host="127.0.0.1", port=8123, api_key=None, model="examples/x")
    text = banner(llm, NAME, args)
    assert "http://127.0.0.1:8123/v1" in text and "plain decoding" in text and NAME in text


def test_bearer_scheme_is_case_insensitive_and_docs_are_off(server):
    url = server[0]
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
    for route in ("/docs", "/redoc", "/openapi.json"):  # only with --enable-docs (the fuzz test turns them on)
        r = httpx.get(url + route)
        assert r.status_code == 404 and "error" in r.json(), route


def test_bodies_that_are_not_json_too_large_or_too_deep_are_4xx(checkpoint):
    """Only application/json bodies reach the API (a text/plain POST is one any web page can send to localhost), a
    body over --max-request-bytes is refused unread past the cap, JSON nested past 64 levels is a 400 (10,000 deep
    was a 500 RecursionError), and with an API key /metrics needs it too unless --public-metrics."""
    with running(LLM(checkpoint), max_request_bytes=4096) as (url, _):
        auth = {"Authorization": f"Bearer {KEY}"}
        body = json.dumps({"model": NAME, "prompt": "x", "max_tokens": 2})
        r = httpx.post(url + "/v1/completions", content=body, headers={**auth, "Content-Type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        r = httpx.post(url + "/v1/completions", content=body, headers=auth)  # no Content-Type at all
        assert r.status_code == 415
        big = json.dumps({"model": NAME, "prompt": "x " * 5000})
        r = httpx.post(url + "/v1/completions", content=big, headers={**auth, "Content-Type": "application/json"})
        assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/metrics", headers=auth).status_code == 200
    with running(LLM(checkpoint), public_metrics=True) as (url, _):
        assert httpx.get(url + "/metrics").status_code == 200
        for depth in (100, 10_000):
            deep = '{"model": "tiny", "prompt": "x", "extra": ' + "[" * depth + "]" * depth + "}"
            r = httpx.post(url + "/v1/completions", content=deep,
                           headers={**auth, "Content-Type": "application/json; charset=utf-8"})
            assert r.status_code == 400 and "deeper than 64 levels" in r.json()["error"]["message"], depth


STALL_S = 2.0


def test_no_hostile_request_stalls_the_others(checkpoint):
    """While a greedy stream runs, requests whose cost the client controls (a 5 MB prompt, a 5 MB chat message, a
    10,000-property schema, a 20,000-word alternation, 100,000 stop strings, a 300 MB body) each get their 4xx with
    an OpenAI error body, the stream never pauses for STALL_S and /health answers within STALL_S throughout: their
    work runs in the preparation threads, bounded by limits checked first, not on the engine thread or the event
    loop. STALL_S is 2 s: 4x the largest gap seen on a machine busy with other work (0.555 s), and far below what
    the work refused here costs where it should not run (tokenizing the 5 MB prompt alone took 12.8 s on 2 cores)."""
    import threading

    llm = LLM(checkpoint, max_num_seqs=4)
    with running(llm, api_key=None) as (url, _):
        gaps, health, done = [], [], threading.Event()

        def stream():  # one greedy stream after another until the hostile requests are done
            body = {"model": NAME, "prompt": "x", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
                    "stream": True}
            while not done.is_set():
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                    assert r.status_code == 200
                    last = None
                    for line in r.iter_lines():
                        now = time.perf_counter()
                        if line and last is not None:
                            gaps.append(now - last)
                        last = now

        def probe():
            while not done.is_set():
                start = time.perf_counter()
                assert httpx.get(url + "/health", timeout=10).status_code == 200
                health.append(time.perf_counter() - start)
                time.sleep(0.02)

        threads = [threading.Thread(target=stream), threading.Thread(target=probe)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the stream is running
        schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
        hostile = [
            ("/v1/completions", {"model": NAME, "prompt": "x = 1\n" * 850_000}, 400),
            ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x = 1\n" * 850_000}]},
             400),
            ("/v1/chat/completions", {"model": NAME, "messages": CHAT, "response_format": {
                "type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}, 400),
            ("/v1/completions", {"model": NAME, "prompt": "x", "guided_regex": "|".join(f"w{i}" for i in
                                                                                       range(20_000))}, 400),
            ("/v1/completions", {"model": NAME, "prompt": "x", "stop": [f"s{i}" for i in range(100_000)]}, 400),
        ]
        for n, (path, body, status) in enumerate(hostile):
            start = time.perf_counter()
            r = httpx.post(url + path, json=body, timeout=60)
            assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}, \
                (path, r.status_code, r.text[:200])
            if n < 2:  # refused on its length in characters, before any tokenizing (which takes seconds)
                assert "characters" in r.json()["error"]["message"] and time.perf_counter() - start < STALL_S

        def chunks():  # 300 MB offered; the server reads 8 MiB of it
            for _ in range(300):
                yield b" " * 2**20

        try:
            r = httpx.post(url + "/v1/completions", content=chunks(), timeout=60,
                           headers={"Content-Type": "application/json"})
            assert r.status_code == 413, r.text[:200]
        except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
            pass  # the server answered 413 and closed the connection while the client was still sending
        done.set()
        for t in threads:
            t.join(timeout=60)
    assert len(gaps) > 50 and len(health) > 10, (len(gaps), len(health))
    print(f"largest stream gap {max(gaps):.3f} s over {len(gaps)} chunks; slowest /health {max(health):.3f} s")
    assert max(gaps) < STALL_S and max(health) < STALL_S, (max(gaps), max(health))
