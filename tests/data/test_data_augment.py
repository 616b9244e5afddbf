"""``augment`` against a fake OpenAI-compatible server on 127.0.0.1 that fails, hangs and lies.

Every turn ends with reasoning or in the failure report. Refusals, corrupt caches, credentials and
``kill -9`` at random points: tests/faults/test_augment_faults.py. Everything is bounded: short
timeouts, few retries, a server that stops with the test.
"""

from __future__ import annotations

import collections
import json

import pytest

from local_server import FakeOpenAI, conversation

from onepass.conversation.parse import parse_record
from onepass.data.augment import AugmentError, Cache, augment, plan_turns, write_failure_report
from onepass.data.chat_client import ChatClient, ClientConfig, parse_json_reply


@pytest.fixture
def server():
    s = FakeOpenAI()
    yield s
    s.close()


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
