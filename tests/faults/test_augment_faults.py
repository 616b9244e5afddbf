"""Augment under faults (issue 13, item 11): a refusal is never accepted as reasoning (also wrapped in the
requested JSON, also from an earlier run's cache), corrupt cache lines are named and requested again, no
credential reaches anything written or printed, and ``kill -9`` at random points loses and repeats nothing.

Every test talks to :class:`local_server.FakeOpenAI` on the loopback with short timeouts. Names the fix
added are imported inside the tests, so each test also runs, and fails on its own assertions, against
the code before the fix (docs/faults.md).
"""

from __future__ import annotations

import json
import random
import re

import pytest
from fault_helpers import kill9, onepass, wait_for
from local_server import REFUSAL, FakeOpenAI, conversation

from onepass.conversation.parse import parse_record
from onepass.data.augment import Cache, augment, plan_turns, write_failure_report
from onepass.data.chat_client import ChatClient, ClientConfig

KEY = "sk-live-0123456789abcdef"
DATA_CLI = "onepass.prepare.data_cli"  # `onepass data` without importing every other command: a faster start


@pytest.fixture
def server():
    s = FakeOpenAI()
    yield s
    s.close()


def _client(url: str, **kw) -> ChatClient:
    cfg = dict(base_url=url, model="fake", timeout=2.0, retries=2, backoff=0.01, max_backoff=0.05,
               api_key_env="ONEPASS_TEST_KEY")
    return ChatClient(ClientConfig(**{**cfg, **kw}))


def _keys(convs) -> dict[tuple[str, int], str]:
    return {(t.conversation, t.turn): t.key for turns in plan_turns(convs, model="fake") for t in turns}


def _augment_cli(data, out, url, *extra, env=None):
    proc = onepass("augment", "--data", str(data), "--out", str(out), "--base-url", url, "--model", "fake",
                   "--concurrency", "3", "--timeout", "5", "--retries", "1", "--backoff", "0.01",
                   "--api-key-env", "ONEPASS_TEST_KEY", "--no-progress", *extra, env=env, module=DATA_CLI)
    text, _ = proc.communicate(timeout=60)
    return proc.returncode, text


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_a_refusal_in_the_requested_json_is_retried_counted_and_reported(tmp_path, server):
    convs = [parse_record(conversation(0, ["ok", "refuseonce"])), parse_record(conversation(1, ["refuse"]))]
    keys = _keys(convs)
    result = augment(convs, _client(server.url), tmp_path / "cache.jsonl", concurrency=2)
    assert [r["id"] for r in result.records] == ["c0"]  # the refusal on a retry's first attempt is not kept
    assert REFUSAL not in json.dumps(result.records) and REFUSAL not in (tmp_path / "cache.jsonl").read_text()
    assert [(f["conversation"], f["turn"], f["refused"], f["attempts"]) for f in result.failures] == [("c1", 1, True, 3)]
    assert result.failures[0]["error"].startswith("refusal: ")
    assert server.received[keys[("c0", 3)]] == 2 and server.received[keys[("c1", 1)]] == 3
    assert result.refused_replies == 1 + 3 and result.refused_turns == 1
    assert "REFUSALS: 4 replies were refusals (retried), 1 turns failed on one" in result.summary()
    report = json.loads(write_failure_report(result, tmp_path / "failures.json").read_text())
    assert report["refused_turns"] == 1 and report["refused_replies"] == 4

    # with the check off the same reply is reasoning (the user's choice, not a silent default)
    from onepass.data.refusal import RefusalCheck

    off = augment(convs[1:], _client(server.url), tmp_path / "off.jsonl", refusal=RefusalCheck.none())
    assert off.records[0]["messages"][1]["reasoning_content"] == REFUSAL


def test_a_refusal_cached_by_an_earlier_run_is_requested_again(tmp_path, server):
    convs = [parse_record(conversation(0, ["ok", "ok"]))]
    keys = _keys(convs)
    cache = tmp_path / "cache.jsonl"
    _jsonl(cache, [{"key": keys[("c0", 1)], "reasoning": REFUSAL}, {"key": keys[("c0", 3)], "reasoning": "fine"}])
    result = augment(convs, _client(server.url), cache)
    assert result.records[0]["messages"][1]["reasoning_content"] == "I think about answer 0.0 [ok]"
    assert result.refused_in_cache == 1 and result.requested == 1 and server.received[keys[("c0", 1)]] == 1
    assert "1 cached refusals requested again" in result.summary()


@pytest.mark.e2e
def test_refusal_patterns_from_the_command_line(tmp_path, server):
    data = _jsonl(tmp_path / "in.jsonl", [conversation(0, ["ok", "ok"]), conversation(1, ["refuse"])])
    rc, text = _augment_cli(data, tmp_path / "out.jsonl", server.url, "--refusal-pattern", r"answer 0\.1")
    assert rc == 1 and "REFUSALS: 4 replies were refusals" in text, text  # 2 attempts each for c0 turn 3 and c1
    failures = json.loads((tmp_path / "out.jsonl.failures.json").read_text())
    assert [(f["conversation"], f["turn"], f["refused"]) for f in failures["failures"]] == [("c0", 3, True),
                                                                                             ("c1", 1, True)]
    rc, text = _augment_cli(data, tmp_path / "out.jsonl", server.url, "--no-refusal-check")
    assert rc == 0 and "2 complete" in text, text

    from onepass.data.refusal import refusal_check
    from onepass.errors import UsageError

    assert refusal_check(extra=["^I think about answer 0\\.1"]).match("I think about answer 0.1 [ok]")
    patterns = tmp_path / "refusals.txt"
    patterns.write_text("# mine only\n\nnope\n")
    assert refusal_check(patterns_file=patterns).patterns == ("nope",)
    with pytest.raises(UsageError, match="not a valid regular expression"):
        refusal_check(extra=["(unclosed"])
    with pytest.raises(UsageError, match="--no-refusal-check cannot go with"):
        refusal_check(extra=["x"], off=True)


def test_corrupt_cache_lines_are_named_and_requested_again(tmp_path, server):
    convs = [parse_record(conversation(i, ["ok"])) for i in range(4)]
    keys = list(_keys(convs).values())
    cache = tmp_path / "cache.jsonl"
    lines = [json.dumps({"key": keys[0], "reasoning": "r0"}), '{"key": "' + keys[1] + '", "reas',  # cut mid-file
             json.dumps({"key": keys[2], "reasoning": None}), json.dumps({"key": keys[3], "reasoning": "r3"})]
    cache.write_bytes(("\n".join(lines) + "\n").encode() + b"\xff\xfe not utf-8\n" + b'{"key": "' + keys[2].encode())
    result = augment(convs, _client(server.url), cache)
    summary = result.summary()
    assert f"CACHE {cache}: 3 corrupt lines ignored (lines 2, 3, 5); their turns were requested again" in summary
    assert f"CACHE {cache}: line 6 was cut (a killed run) and removed" in summary
    assert result.cache_corrupt_lines == [2, 3, 5] and result.cache_cut_line == 6
    assert result.from_cache == 2 and result.requested == 2 and len(result.records) == 4
    assert {k: server.received[k] for k in keys} == {keys[0]: 0, keys[1]: 1, keys[2]: 1, keys[3]: 0}
    with Cache(cache) as again:  # the corrupt lines stay (append-only) and are named on every run
        assert again.corrupt_lines == [2, 3, 5] and again.cut_line is None and len(again.results) == 4


@pytest.mark.parametrize("text", [
    f"401: header 'Authorization: Bearer {KEY}'", f'{{"authorization": "Bearer {KEY}"}}',
    f"x-api-key: {KEY}", f"{{'X-Goog-Api-Key': '{KEY}'}}", f"GET https://h/v1/models?alt=json&key={KEY}",
    f"https://h/v1?access_token={KEY}&x=1", f"token Bearer {KEY}"])
def test_scrub_masks_every_form_of_a_credential(text):
    # without the key itself: a credential the client did not send (a proxy's) is masked as well
    from onepass.data.chat_client import scrub

    assert "0123456789abcdef" not in scrub(text) and "***" in scrub(text)


@pytest.mark.e2e
def test_no_credential_reaches_anything_written_or_printed(tmp_path, server):
    data = _jsonl(tmp_path / "in.jsonl", [conversation(0, ["ok"]), conversation(1, ["echo500"]),
                                          conversation(2, ["echojson"]), conversation(3, ["echoreason"])])
    out = tmp_path / "out.jsonl"
    rc, text = _augment_cli(data, out, server.url, env={"ONEPASS_TEST_KEY": KEY})
    assert rc == 1 and "2 complete" in text, text
    assert "Authorization: Bearer ***" in (tmp_path / "out.jsonl.cache.jsonl").read_text()  # in the reasoning
    failures = json.loads((tmp_path / "out.jsonl.failures.json").read_text())["failures"]
    assert {f["conversation"] for f in failures} == {"c1", "c2"}
    assert all("Authorization: Bearer ***" in f["error"] for f in failures), failures  # the echo is there, masked
    rc, fatal = _augment_cli(_jsonl(tmp_path / "401.jsonl", [conversation(5, ["echo401"])]), tmp_path / "o401.jsonl",
                             server.url, env={"ONEPASS_TEST_KEY": KEY})
    assert rc == 2 and "onepass: error:" in fatal and "HTTP 401" in fatal and "Authorization: Bearer ***" in fatal, fatal
    written = [p for p in tmp_path.iterdir() if p.is_file()]
    assert {p.name for p in written} >= {"out.jsonl", "out.jsonl.cache.jsonl", "out.jsonl.failures.json"}
    for where, blob in [("stdout", text), ("fatal stderr", fatal)] + [(p.name, p.read_text()) for p in written]:
        assert KEY not in blob and "0123456789abcdef" not in blob, where


def _cache_lines(path) -> tuple[list[dict], bytes]:
    """Complete lines parsed (each must), and the cut tail after the last newline."""
    data = path.read_bytes() if path.exists() else b""
    head, _, tail = data.rpartition(b"\n")
    return [json.loads(line) for line in head.split(b"\n") if line] if head else [], tail


@pytest.mark.e2e
def test_kill_9_at_random_points_loses_and_repeats_nothing(tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    server = FakeOpenAI(delay=0.02)
    try:
        convs = [conversation(i, ["ok", "ok"]) for i in range(30)]
        data = _jsonl(tmp_path / "in.jsonl", convs)
        out, cache = tmp_path / "out.jsonl", tmp_path / "out.jsonl.cache.jsonl"
        argv = ["augment", "--data", data, "--out", str(out), "--base-url", server.url, "--model", "fake",
                "--concurrency", "3", "--timeout", "5", "--retries", "1", "--backoff", "0.01",
                "--api-key-env", "ONEPASS_TEST_KEY", "--no-progress"]
        cached_at_kill: list[tuple[int, set[str]]] = []  # (requests the server had seen, keys cached) per kill
        for _ in range(3):
            before = len(_cache_lines(cache)[0])
            target = before + rng.randint(1, 15)
            proc = onepass(*argv, module=DATA_CLI)
            wait_for(lambda: len(_cache_lines(cache)[0]) >= target or proc.poll() is not None, 30, every=0.005)
            if proc.poll() is not None:  # finished before the kill point
                assert proc.returncode == 0, f"seed {seed}: {proc.stdout.read()}"
                break
            kill9(proc)
            entries, tail = _cache_lines(cache)  # every complete line parses; at most the last one is cut
            with server.lock:
                cached_at_kill.append((len(server.log), {e["key"] for e in entries}))
            assert not out.exists(), f"seed {seed}"
        entries, _ = _cache_lines(cache)
        data_bytes = cache.read_bytes()  # cut the last result in half: what a kill inside write() would leave
        start = data_bytes.rstrip(b"\n").rfind(b"\n") + 1
        cache.write_bytes(data_bytes[:start + (len(data_bytes) - start) // 2])
        cut_at, cut_key = len(entries), entries[-1]["key"]
        rc, text = _augment_cli(data, out, server.url)
        assert rc == 0, f"seed {seed}: {text}"
        assert re.search(rf"line {cut_at} was cut \(a killed run\) and removed", text), f"seed {seed}: {text}"
        final, tail = _cache_lines(cache)
        keys = [e["key"] for e in final]
        assert tail == b"" and len(keys) == len(set(keys)) == 60, f"seed {seed}"  # every turn once, none lost
        assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [c["id"] for c in convs]
        for seen, cached in cached_at_kill:  # a result in the cache at a kill is never asked for again
            assert not cached & set(server.log[seen:]) - {cut_key}, f"seed {seed}"
        repeats = sum(server.received.values()) - 60
        assert 0 <= repeats <= 3 * len(cached_at_kill) + 1, f"seed {seed}: {repeats} repeated requests"
        assert set(server.received) == set(keys)
    finally:
        server.close()
