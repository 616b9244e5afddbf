"""``augment`` against a fake OpenAI-compatible server on 127.0.0.1 that fails, hangs and lies.

Every turn ends with reasoning or in the failure report; a run killed with SIGKILL and
restarted finishes with no request repeated after its result was cached and none lost.
Everything is bounded: short timeouts, few retries, a server that stops with the test.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from local_server import JSONHandler, LocalServer

from onepass.conversation import parse_record
from onepass.data.augment import AugmentError, Cache, augment, plan_turns, request_key, write_failure_report
from onepass.data.chat_client import ChatClient, ClientConfig, parse_json_reply

REPLY_MARK = "The assistant's reply:\n"


class FakeOpenAI(LocalServer):
    """Chat-completions on an ephemeral loopback port. The behaviour of a request is chosen by the
    tag in the reply it asks about (``[ok]``, ``[500once]``, ``[hangonce]``, ``[badjsononce]``,
    ``[always500]``, ``[400]``, ``[401]``); ``received`` counts requests per augment key."""

    def __init__(self, *, delay: float = 0.0, hang: float = 1.0) -> None:
        self.received: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        server = self

        class Handler(JSONHandler):
            def do_POST(self):
                body = self.read_json()
                key = request_key(body["model"], body["messages"])
                reply = body["messages"][-1]["content"].split(REPLY_MARK, 1)[1]
                tag = reply[reply.index("[") + 1:reply.index("]")]
                with server.lock:
                    server.received[key] += 1
                    attempt = server.received[key]
                try:
                    server.respond(self, tag, attempt, reply)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout): fine

        self.delay, self.hang = delay, hang
        self.start(Handler)

    def respond(self, h: JSONHandler, tag: str, attempt: int, reply: str) -> None:
        if tag == "always500" or (tag == "500once" and attempt == 1):
            return h.send_json(500, {"error": "boom"})
        if tag in ("400", "401"):
            return h.send_json(int(tag), {"error": "no"})
        if tag == "hangonce" and attempt == 1:
            time.sleep(self.hang)
        time.sleep(self.delay)
        content = "this is not JSON" if tag == "badjsononce" and attempt == 1 else \
            json.dumps({"reasoning": f"I think about {json.loads(reply)['content']}"})
        h.send_json(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})


@pytest.fixture
def server():
    s = FakeOpenAI()
    yield s
    s.close()


def conversation(i: int, tags: list[str]) -> dict:
    messages = []
    for k, tag in enumerate(tags):
        messages += [{"role": "user", "content": f"question {i}.{k}"},
                     {"role": "assistant", "content": f"answer {i}.{k} [{tag}]"}]
    return {"id": f"c{i}", "messages": messages}


def client(url: str, **kw) -> ChatClient:
    cfg = dict(base_url=url, model="fake", timeout=0.3, retries=2, backoff=0.01, max_backoff=0.05, api_key_env="NOPE")
    return ChatClient(ClientConfig(**{**cfg, **kw}))


def test_every_turn_ends_with_reasoning_or_in_the_failure_report(tmp_path, server):
    records = [conversation(0, ["ok", "500once", "ok"]), conversation(1, ["hangonce", "badjsononce"]),
               conversation(2, ["ok", "always500"]), conversation(3, ["400"]), conversation(4, ["ok"])]
    convs = [parse_record(r) for r in records]
    cache = tmp_path / "cache.jsonl"
    result = augment(convs, client(server.url), cache, concurrency=3)
    keys = {(t.conversation, t.turn): t.key for turns in plan_turns(convs, model="fake") for t in turns}
    assert len(keys) == result.turns == 9
    failed = {(f["conversation"], f["turn"]): f for f in result.failures}
    assert set(failed) == {("c2", 3), ("c3", 1)}
    assert failed[("c2", 3)]["attempts"] == 3 and "HTTP 500" in failed[("c2", 3)]["error"]
    assert failed[("c3", 1)]["attempts"] == 1 and "HTTP 400" in failed[("c3", 1)]["error"]
    # every other turn has reasoning in the cache; complete conversations are in the output
    cached = {json.loads(x)["key"] for x in cache.read_text().splitlines()}
    assert cached == {k for where, k in keys.items() if where not in failed}
    assert [r["id"] for r in result.records] == ["c0", "c1", "c4"]
    for r in result.records:
        for m in r["messages"]:
            if m["role"] == "assistant":
                assert m["reasoning_content"] == f"I think about {m['content']}"
    # retried as planned: one retry for each transient failure, 3 attempts for the hopeless one
    assert server.received[keys[("c0", 3)]] == server.received[keys[("c1", 1)]] == 2
    assert server.received[keys[("c1", 3)]] == 2 and server.received[keys[("c2", 3)]] == 3
    assert result.requested == 9 and result.succeeded == 7 and result.conversations_incomplete == 2
    report = write_failure_report(result, tmp_path / "failures.json")
    assert json.loads(report.read_text())["failed_turns"] == 2

    # a rerun sends only the two failed requests again
    before = collections.Counter(server.received)
    again = augment(convs, client(server.url), cache, concurrency=3)
    assert again.from_cache == 7 and again.requested == 2
    assert server.received - before == collections.Counter({keys[("c2", 3)]: 3, keys[("c3", 1)]: 1})


def test_unauthorised_endpoint_stops_the_run(tmp_path, server):
    convs = [parse_record(conversation(i, ["401"])) for i in range(5)]
    with pytest.raises(AugmentError, match="HTTP 401"):
        augment(convs, client(server.url), tmp_path / "cache.jsonl", concurrency=2)
    assert sum(server.received.values()) <= 2  # no new request after the first refusal


def test_cache_repairs_a_cut_line_and_refuses_a_second_run(tmp_path):
    path = tmp_path / "cache.jsonl"
    good = json.dumps({"key": "k1", "conversation": "c", "turn": 1, "reasoning": "r"})
    path.write_text(good + "\n" + '{"key": "k2", "reas')
    with Cache(path) as cache:
        assert cache.results == {"k1": "r"}
        assert path.read_text() == good + "\n"
        with pytest.raises(AugmentError, match="in use"):
            Cache(path)


@pytest.mark.parametrize(("text", "ok"), [
    ('{"reasoning": "r"}', "r"), ('```json\n{"reasoning": " r "}\n```', "r"), ('{"thought": "t"}', "t"),
    ('{"reasoning": ""}', None), ('["r"]', None), ("no", None)])
def test_parse_json_reply(text, ok):
    if ok is None:
        with pytest.raises(ValueError):
            parse_json_reply(text, "reasoning", ("thought",))
    else:
        assert parse_json_reply(text, "reasoning", ("thought",)) == ok


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_killed_and_restarted_run_repeats_and_loses_nothing(tmp_path):
    server = FakeOpenAI(delay=0.03)
    try:
        data = tmp_path / "in.jsonl"
        data.write_text("".join(json.dumps(conversation(i, ["ok", "ok"])) + "\n" for i in range(40)))
        out, cache = tmp_path / "out.jsonl", tmp_path / "cache.jsonl"
        cmd = [sys.executable, "-m", "onepass.data.cli", "augment", "--data", str(data), "--out", str(out),
               "--cache", str(cache), "--base-url", server.url, "--model", "fake", "--concurrency", "3",
               "--timeout", "5", "--retries", "1", "--backoff", "0.01", "--api-key-env", "NOPE", "--no-progress"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while len(_lines(cache)) < 20 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.02)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        assert first.returncode == -signal.SIGKILL, first.stderr.read().decode()
        done_before = {e["key"] for e in _lines(cache)}
        assert 20 <= len(done_before) < 80 and not out.exists()

        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 0, second.stderr
        assert "turns 80:" in second.stdout and f"{len(done_before)} from the cache" in second.stdout
        entries = _lines(cache)
        keys = [e["key"] for e in entries]
        assert len(keys) == len(set(keys)) == 80  # no duplicate, none lost
        assert all(server.received[k] == 1 for k in done_before)  # never asked again once cached
        assert set(server.received) == set(keys)
        assert sum(server.received.values()) <= 80 + 3  # at most the in-flight ones were lost at the kill
        assert len(_lines(out)) == 40
    finally:
        server.close()
