"""The client of running servers against stand-ins that misbehave: a request has a wall-clock deadline however the
server sends (or drips) its answer, an answer over the size cap is refused as it arrives, an answer of the wrong
shape is one line naming the URL and the field, and /metrics is read by the Prometheus format's fields."""

import json
import math
import re
import threading
import time
import tracemalloc
from collections.abc import Callable

import httpx
import pytest
from tiny import reply, stand_in

from eyas.client import ServerClient, ServerError, parse_spec_counters

MESSAGES = [{"role": "user", "content": "x"}]
ANSWER = {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}


def bounded(call: Callable[[], object], seconds: float) -> tuple[BaseException | None, float]:
    """Run `call` in a thread for at most `seconds`: (what it raised, seconds it took). A call still running then
    fails the test (instead of hanging the run)."""
    outcome: list = []

    def run():
        start = time.monotonic()
        try:
            call()
            outcome.append((None, time.monotonic() - start))
        except BaseException as e:
            outcome.append((e, time.monotonic() - start))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"the request was still running after {seconds} s"
    return outcome[0]


# -- the deadline ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["body", "headers"])
def test_a_server_dripping_its_answer_is_cut_at_the_deadline_and_retried(where):
    """One byte every 0.2 s never trips httpx's per-read timeout; the deadline (the whole request) does, in the
    headers as in the body, and counts as a timeout: retried, then one line naming the URL."""
    stop, tries = threading.Event(), []

    def drip(h):
        tries.append(time.monotonic())
        if where == "body":
            h.send_response(200)
            h.send_header("Content-Length", "100000")
            h.end_headers()
        else:
            h.wfile.write(b"HTTP/1.1 200 OK\r\n")
        while not stop.wait(0.2):
            h.wfile.write(b" " if where == "body" else b"X")

    with stand_in(drip) as url:
        client = ServerClient(url, model="m", timeout=0.5, retries=1, backoff=0)
        try:
            error, seconds = bounded(lambda: client.chat(MESSAGES, 4), 2 * 0.5 + 3)
        finally:
            stop.set()
    assert isinstance(error, ServerError), error
    message = str(error)
    assert message.startswith(f"{url}/v1/chat/completions: ") and "no complete answer within 0.5 s" in message
    assert "(after 2 tries)" in message and "\n" not in message and len(tries) == 2
    assert seconds < 2 * 0.5 + 2


def test_a_transport_without_sockets_is_cut_between_chunks():
    """Whatever the transport (a proxy's, a test's), the body is read against the deadline chunk by chunk."""
    stop = threading.Event()

    def slow_body():
        while not stop.wait(0.1):
            yield b" "

    client = ServerClient("http://slow:8000", model="m", timeout=0.5, retries=0,
                          transport=httpx.MockTransport(lambda r: httpx.Response(200, content=slow_body())))
    try:
        error, seconds = bounded(lambda: client.chat(MESSAGES, 4), 0.5 + 3)
    finally:
        stop.set()
    assert isinstance(error, ServerError) and "DeadlineExceeded: no complete answer within 0.5 s" in str(error)
    assert seconds < 0.5 + 2


# -- the size cap ---------------------------------------------------------------------------------------------------

def test_an_answer_over_the_cap_is_refused_as_it_arrives_with_memory_bounded():
    """32 MiB sent with no Content-Length to a client capped at 1 MiB: it stops reading past the cap, so its memory
    never holds the answer."""
    cap, chunk, total = 2**20, b" " * 2**16, 32 * 2**20
    sent = []

    def big(h):
        h.send_response(200)  # HTTP/1.0: the body runs to the connection's close
        h.end_headers()
        for _ in range(total // len(chunk)):
            h.wfile.write(chunk)
            sent.append(len(chunk))

    with stand_in(big) as url:
        client = ServerClient(url, model="m", timeout=30, retries=0, max_response_bytes=cap)
        tracemalloc.start()
        try:
            with pytest.raises(ServerError) as refused:
                client.chat(MESSAGES, 4)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        time.sleep(0.2)  # the server's last writes fail once the client has hung up
    assert str(refused.value) == (f"{url}/v1/chat/completions: the answer is larger than {cap} bytes; stopped "
                                  "reading there")
    assert peak < cap + 2 * 2**20, peak  # the cap and a few reads (1.4 MiB in all here), not the 32 MiB
    assert sum(sent) < total


def test_a_declared_length_over_the_cap_is_refused_before_reading():
    def huge(h):
        h.send_response(200)
        h.send_header("Content-Length", str(200 * 2**20))
        h.end_headers()
        h.wfile.write(b"{")  # and nothing more: a client that waits for the rest times out

    with stand_in(huge) as url:
        client = ServerClient(url, model="m", timeout=2, retries=0, max_response_bytes=2**20)
        error, _ = bounded(lambda: client.chat(MESSAGES, 4), 2 + 3)
    assert isinstance(error, ServerError) and f"the answer is {200 * 2**20} bytes; at most {2**20} are read" in str(
        error)


def test_a_refusal_is_one_line_however_long_its_body():
    def refuse(h):
        reply(h, "Traceback (most recent call last):\n  File ...\n" + "x" * 2**20, status=400)

    with stand_in(refuse) as url:
        with pytest.raises(ServerError) as refused:
            ServerClient(url, model="m", retries=0).chat(MESSAGES, 4)
    message = str(refused.value)
    assert message.startswith(f"{url}/v1/chat/completions: HTTP 400: Traceback (most recent call last): File ...")
    assert "\n" not in message and len(message) < 500


# -- the shape of answers -------------------------------------------------------------------------------------------

def choice(**fields) -> dict:
    return {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop", **fields}],
            "usage": {"completion_tokens": 1}}


WRONG_ANSWERS = {
    "a list": ([ANSWER], "the answer is a JSON list; expected an object"),
    "not JSON": ("<html>502 Bad Gateway</html>", "the answer is not JSON"),
    "nested past recursion": ("[" * 100_000, "the answer is not JSON"),
    "no choices": ({"usage": {"completion_tokens": 1}}, "choices is missing"),
    "empty choices": ({"choices": [], "usage": {"completion_tokens": 1}}, "choices is []"),
    "choices of strings": ({"choices": ["ok"], "usage": {"completion_tokens": 1}}, 'choices is ["ok"]'),
    "neither message nor text": ({"choices": [{"finish_reason": "stop"}], "usage": {"completion_tokens": 1}},
                                 "choices[0] has neither message nor text"),
    "message a string": ({"choices": [{"message": "ok", "finish_reason": "stop"}], "usage": {"completion_tokens": 1}},
                         'choices[0].message is "ok"; expected an object'),
    "content a list": (choice(message={"content": ["ok"]}), 'choices[0].message.content is ["ok"]; expected a string'),
    "text a number": ({"choices": [{"text": 5, "finish_reason": "stop"}], "usage": {"completion_tokens": 1}},
                      "choices[0].text is 5; expected a string"),
    "no usage": ({"choices": ANSWER["choices"]}, "usage.completion_tokens is missing"),
    "tokens a string": ({**ANSWER, "usage": {"completion_tokens": "12"}}, 'usage.completion_tokens is "12"'),
    "tokens a bool": ({**ANSWER, "usage": {"completion_tokens": True}}, "usage.completion_tokens is true"),
    "tokens negative": ({**ANSWER, "usage": {"completion_tokens": -3}}, "usage.completion_tokens is -3"),
    "tokens fractional": ({**ANSWER, "usage": {"completion_tokens": 2.5}}, "usage.completion_tokens is 2.5"),
    "no finish_reason": (choice(finish_reason=None), "choices[0].finish_reason is null; expected a string"),
    "token_ids a string": (choice(token_ids="1 2"), 'choices[0].token_ids is "1 2"'),
    "token_ids negative": (choice(token_ids=[1, -2]), "choices[0].token_ids[1] is -2"),
    "token_ids of bools": (choice(token_ids=[1, True]), "choices[0].token_ids[1] is true"),
    "meta_info a list": ({**ANSWER, "meta_info": [4]}, "meta_info is [4]; expected an object"),
    "verify count a string": ({**ANSWER, "meta_info": {"spec_verify_ct": "4"}}, 'meta_info.spec_verify_ct is "4"'),
    "histogram an object": ({**ANSWER, "meta_info": {"spec_verify_ct": 4, "spec_accept_histogram": {"0": 4}}},
                            'meta_info.spec_accept_histogram is {"0": 4}'),
    "histogram of strings": ({**ANSWER, "meta_info": {"spec_verify_ct": 4, "spec_accept_histogram": [0, "4"]}},
                             'meta_info.spec_accept_histogram[1] is "4"'),
    "choice's meta_info": (choice(meta_info={"spec_verify_ct": -1}), "choices[0].meta_info.spec_verify_ct is -1"),
}


@pytest.mark.parametrize("case", list(WRONG_ANSWERS))
def test_an_answer_of_the_wrong_shape_is_one_line_naming_the_url_and_the_field(case):
    answer, expected = WRONG_ANSWERS[case]
    text = answer if isinstance(answer, str) else json.dumps(answer)
    client = ServerClient("http://odd:8000", model="m", retries=0,
                          transport=httpx.MockTransport(lambda r: httpx.Response(200, text=text)))
    with pytest.raises(ServerError) as refused:
        client.chat(MESSAGES, 4)
    message = str(refused.value)
    assert message.startswith("http://odd:8000/v1/chat/completions: ") and expected in message, message
    assert "\n" not in message and len(message) < 300


@pytest.mark.parametrize("models, expected", [({"data": []}, "data[0].id is missing"),
                                              ({"data": [{"id": 3}]}, "data[0].id is 3"),
                                              ({"object": "list"}, "data[0].id is missing"),
                                              ([{"id": "m"}], "the answer is a JSON list")])
def test_models_without_a_name_are_one_line(models, expected):
    transport = httpx.MockTransport(lambda r: httpx.Response(200, json=models))
    with pytest.raises(ServerError, match=f"^http://odd:8000/v1/models: .*{re.escape(expected)}"):
        ServerClient("http://odd:8000", retries=0, transport=transport)


def test_well_formed_answers_still_read():
    sglang = {"choices": [{"text": "x", "finish_reason": "length", "token_ids": [3, 4]}],
              "usage": {"completion_tokens": 2}, "meta_info": {"spec_verify_ct": 1, "spec_accept_histogram": [0, 1]}}
    tool_call = {"choices": [{"message": {"content": None, "tool_calls": []}, "finish_reason": "tool_calls"}],
                 "usage": {"completion_tokens": 0}}
    answers = iter([sglang, tool_call])
    client = ServerClient("http://ok:8000", model="m", retries=0,
                          transport=httpx.MockTransport(lambda r: httpx.Response(200, json=next(answers))))
    first = client.completion("p", 2)
    assert (first.text, first.completion_tokens, first.token_ids, first.spec_verify_steps,
            first.spec_accept_histogram) == ("x", 2, [3, 4], 1, [0, 1])
    assert client.chat(MESSAGES, 2).text == ""


# -- /metrics -------------------------------------------------------------------------------------------------------

METRICS = r'''# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="my model"} 120.0 1712345678000
vllm:spec_decode_num_drafts_total{engine="1",model_name="a \"quoted\" name, {braces} and \\"} 30
vllm:spec_decode_num_drafts_created{engine="0",model_name="my model"} 1.7123456e+09
vllm:spec_decode_num_draft_tokens {model_name="z"} 6 -17
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} NaN
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m m",position="0"} 80.0 1712345678000
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1",model_name="p\no"} 40
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1",model_name="q",} 2e1
unrelated{a="b c"} +Inf
also_unrelated -Inf
''' + 'vllm:spec_decode_num_draft_tokens_total{model_name="x y"}   450   \n'


def test_metrics_are_read_by_the_formats_fields():
    """The value is the field after the labels (not the last one: a timestamp may follow), labels may hold spaces,
    quotes, braces and a trailing comma, a counter may carry _total, and NaN is a value."""
    counters = parse_spec_counters(METRICS)
    assert set(counters) == {"vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                             "vllm:spec_decode_num_accepted_tokens", "per_pos:0", "per_pos:1"}
    assert counters["vllm:spec_decode_num_drafts"] == 150  # the _created sample is not a count
    assert counters["vllm:spec_decode_num_draft_tokens"] == 456
    assert math.isnan(counters["vllm:spec_decode_num_accepted_tokens"])
    assert (counters["per_pos:0"], counters["per_pos:1"]) == (80, 60)


def test_metrics_agree_with_prometheus_client_parser():
    parser = pytest.importorskip("prometheus_client.parser")
    ours = parse_spec_counters(METRICS)
    theirs: dict[str, float] = {}
    for family in parser.text_string_to_metric_families(METRICS.replace(" {", "{")):
        for s in family.samples:
            name = s.name.removesuffix("_total")
            key = f"per_pos:{s.labels['position']}" if name.endswith("_per_pos") else name
            if key in ours:
                theirs[key] = theirs.get(key, 0.0) + s.value
    assert set(theirs) == set(ours)
    for key in ours:
        assert ours[key] == theirs[key] or math.isnan(ours[key]) and math.isnan(theirs[key]), key


@pytest.mark.parametrize("line, why", [('vllm:spec_decode_num_drafts_total{engine="0 12', "closing quote"),
                                       ('vllm:spec_decode_num_drafts_total{engine="0" 12', "without '='"),
                                       ("vllm:spec_decode_num_drafts_total twelve", "'twelve' is not a number"),
                                       ("vllm:spec_decode_num_drafts_total 1 2 3", "at most a timestamp"),
                                       ('vllm:spec_decode_num_accepted_tokens_per_pos{position="k"} 1',
                                        "position 'k'")])
def test_a_malformed_counter_names_the_line_and_the_server(line, why):
    with pytest.raises(ValueError, match=f"line 2 .*{why}"):
        parse_spec_counters("# HELP x\n" + line + "\n")
    client = ServerClient("http://odd:8000", model="m", retries=0,
                          transport=httpx.MockTransport(lambda r: httpx.Response(200, text="# x\n" + line)))
    with pytest.raises(ServerError, match=f"^http://odd:8000/metrics: line 2 .*{why}"):
        client.spec_counters()


@pytest.mark.parametrize("before, after, expected", [
    ({"vllm:spec_decode_num_drafts": 2000.0}, {"vllm:spec_decode_num_drafts": 20.0},
     "counter vllm:spec_decode_num_drafts went from 2000 to 20: the server restarted or the counter was reset; "
     "rerun"),
    ({"per_pos:1": 9.0}, {"per_pos:1": 3.0},
     'counter vllm:spec_decode_num_accepted_tokens_per_pos{position="1"} went from 9 to 3'),
    ({"per_pos:0": 9.0}, {}, 'counter vllm:spec_decode_num_accepted_tokens_per_pos{position="0"} disappeared'),
    ({}, {"vllm:spec_decode_num_drafts": math.nan}, "counter vllm:spec_decode_num_drafts is nan"),
    ({}, {"vllm:spec_decode_num_drafts": math.inf}, "counter vllm:spec_decode_num_drafts is inf"),
    ({}, {"vllm:spec_decode_num_drafts": 12.5}, "counter vllm:spec_decode_num_drafts is 12.5"),
    ({}, {"vllm:spec_decode_num_drafts": -4.0}, "counter vllm:spec_decode_num_drafts is -4"),
])
def test_counters_that_cannot_be_counted_are_refused(before, after, expected):
    from eyas.client import counter_deltas

    with pytest.raises(ServerError) as refused:
        counter_deltas("http://vllm:8000", before, after)
    assert str(refused.value).startswith("http://vllm:8000/metrics: ") and expected in str(refused.value)
    assert counter_deltas("http://vllm:8000", {"a": 3.0}, {"a": 10.0, "b": 2.0}) == {"a": 7, "b": 2}


# -- bench serve ----------------------------------------------------------------------------------------------------

def test_bench_cuts_a_dripping_stream_and_distrusts_counters_that_went_backwards(capsys):
    import asyncio

    from eyas.bench import BenchRequest, acceptance, send

    stop, results = threading.Event(), []

    def drip(h):
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.end_headers()
        while not stop.wait(0.2):
            h.wfile.write(b": still here\n")

    async def one(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=0.5) as http:
            return await send(http, "m", BenchRequest("completions", "p", 1, 4), 0.0, timeout=1.0)

    with stand_in(drip) as url:
        try:
            error, _ = bounded(lambda: results.append(asyncio.run(one(url))), 1.0 + 3)
        finally:
            stop.set()
    assert error is None and results[0].error == "TimeoutError: no complete answer within 1 s"
    before = {"drafts": 100.0, "draft_tokens": 300.0, "accepted": 150.0}
    assert acceptance(before, {"drafts": 10.0, "draft_tokens": 30.0, "accepted": 15.0}, "http://vllm:8000") is None
    assert "counter vllm:spec_decode_num_drafts went from 100 to 10" in capsys.readouterr().err
