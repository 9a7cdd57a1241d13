"""`eyas regenerate`: assistant turns replaced by the target's own answers; interrupted runs resume."""

import json

import pytest
from tiny import make_tokenized_target, running

from eyas import LLM, SamplingParams
from eyas.cli import main as cli
from eyas.train.regenerate import regenerate

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"},
                  {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "again"},
                  {"role": "assistant", "content": "old 2"}]},
    {"conversations": [{"from": "human", "value": "import os"}, {"from": "gpt", "value": "old"}]},
    {"messages": [{"role": "user", "content": "class A:"}, {"role": "assistant", "content": "x"}]},
]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_tokenized_target(path)
    return path


def test_assistant_turns_are_the_targets_answers(target):
    from eyas.train.regenerate import normalise

    llm = LLM(target)
    params = SamplingParams(temperature=0, max_tokens=6)
    convs = [normalise(c, "test") for c in CONVERSATIONS]
    out = regenerate(llm, convs, params)
    for before, after in zip(convs, out):
        assert [m["role"] for m in before] == [m["role"] for m in after]
        for i, (b, a) in enumerate(zip(before, after)):
            if b["role"] != "assistant":
                assert a == b
            else:  # the answer the target gives to the regenerated conversation so far
                assert a["content"] == llm.generate([after[:i]], params)[0].text != b["content"]


def test_cli_resumes_after_an_interruption(target, tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    args = ["regenerate", str(data), "", "--model", str(target), "--max-new-tokens", "5", "--chunk-size", "1"]
    full = tmp_path / "full.jsonl"
    assert cli(args[:2] + [str(full)] + args[3:]) == 0
    lines = full.read_text().splitlines()
    assert len(lines) == 3
    cut = tmp_path / "cut.jsonl"
    cut.write_text(lines[0] + "\n" + lines[1][:10])  # killed while writing the second chunk
    assert cli(args[:2] + [str(cut)] + args[3:]) == 0
    assert cut.read_text() == full.read_text()


# -- through a running server ---------------------------------------------------------------------------------------

def test_server_answers_equal_the_in_process_ones_and_resume(target, tmp_path):
    """`eyas serve` stands in for a vLLM cluster: regenerate --server writes what in-process regenerate writes
    (greedy), and a run cut short resumes with nothing lost and nothing twice."""
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS * 3))
    local = tmp_path / "local.jsonl"
    assert cli(["regenerate", str(data), str(local), "--model", str(target), "--max-new-tokens", "5"]) == 0
    with running(LLM(target, max_num_seqs=4), api_key="k") as (url, _):
        remote = tmp_path / "remote.jsonl"
        args = ["regenerate", str(data), str(remote), "--server", url, "--api-key", "k", "--max-new-tokens", "5",
                "--concurrency", "3"]
        assert cli(args) == 0
        assert remote.read_text() == local.read_text()
        lines = remote.read_text().splitlines()
        remote.write_text("\n".join(lines[:4]) + "\n" + lines[4][:7])  # killed while writing record 5
        assert cli(args) == 0
        assert remote.read_text() == local.read_text()
        unauthorized = tmp_path / "401.jsonl"
        with pytest.raises(Exception) as refused:
            from eyas.client import ServerClient

            ServerClient(url, retries=0)
        assert "HTTP 401" in str(refused.value) and url in str(refused.value)
        assert cli(args[:2] + [str(unauthorized)] + args[3:5] + args[7:]) == 2 and not unauthorized.exists()


def test_client_retries_with_backoff_then_names_the_url_and_status():
    import httpx

    from eyas.client import ServerClient, ServerError

    calls = []

    def flaky(request):
        calls.append(request.url.path)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if len(calls) < 4:
            return httpx.Response(503, text="busy")
        return httpx.Response(200, json={"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
                                         "usage": {"completion_tokens": 1}})

    client = ServerClient("http://cluster:8000", retries=4, backoff=0, transport=httpx.MockTransport(flaky))
    assert client.chat([{"role": "user", "content": "x"}], 4).text == "ok" and len(calls) == 4
    always = ServerClient("http://cluster:8000", model="m", retries=2, backoff=0,
                          transport=httpx.MockTransport(lambda r: httpx.Response(502, text="bad gateway")))
    with pytest.raises(ServerError, match=r"http://cluster:8000/v1/chat/completions: HTTP 502: bad gateway"):
        always.chat([{"role": "user", "content": "x"}], 4)
    refused = ServerClient("http://cluster:8000", model="m", retries=0,
                           transport=httpx.MockTransport(lambda r: httpx.Response(400, text="no such field")))
    with pytest.raises(ServerError, match="HTTP 400: no such field"):
        refused.chat([{"role": "user", "content": "x"}], 4)

    def down(request):
        raise httpx.ConnectError("connection refused")

    with pytest.raises(ServerError, match=r"http://cluster:8000/v1/models: ConnectError: connection refused "
                                          r"\(after 2 tries\)"):
        ServerClient("http://cluster:8000", retries=1, backoff=0, transport=httpx.MockTransport(down))


@pytest.mark.parametrize("failure", ["5xx", "timeout", "dropped"])
def test_a_server_that_fails_mid_run_stops_it_naming_why_with_the_records_done_kept(tmp_path, capsys, failure):
    """A server answers the first 4 requests (2 conversations), then fails: 500s, answers too slowly, or drops the
    connection. regenerate exits non-zero with the URL and what happened, and the two finished records stay."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answered = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply(200, {"data": [{"id": "m"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if len(answered) >= 4:
                if failure == "timeout":
                    time.sleep(1.0)
                elif failure == "dropped":
                    server.shutdown_request(self.request)
                    return
                self.reply(500, {"error": {"message": "engine died"}})
                return
            answered.append(1)
            self.reply(200, {"choices": [{"message": {"content": f"answer {len(answered)}"},
                                          "finish_reason": "stop"}], "usage": {"completion_tokens": 2}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    data = tmp_path / "in.jsonl"
    two_turns = CONVERSATIONS[0]["messages"][1:]  # user, assistant, user, assistant: 2 requests each
    data.write_text("".join(json.dumps({"messages": two_turns}) + "\n" for _ in range(4)))
    out = tmp_path / "out.jsonl"
    try:
        code = cli(["regenerate", str(data), str(out), "--server", url, "--concurrency", "1", "--retries", "1",
                    "--request-timeout", "0.3"])
    finally:
        server.shutdown()
    message = capsys.readouterr().err
    assert code == 2 and url in message, message
    assert {"5xx": "HTTP 500", "timeout": "ReadTimeout", "dropped": "after 2 tries"}[failure] in message, message
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"][1]["content"] for r in kept] == ["answer 1", "answer 3"]
