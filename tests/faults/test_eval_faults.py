"""``eval --backend openai`` that stops part way (issue 24, item 7): every reply paid for is cached as it
arrives (``OUT/answers.jsonl``), so the next run requests only what is missing. Before the fix an
interrupted evaluation (Ctrl-C after 83 paid requests, a server that fails) kept nothing to resume from.
"""

from __future__ import annotations

import collections
import json
import threading

import pytest

from fault_helpers import onepass
from local_server import JSONHandler, LocalServer


class CountingServer(LocalServer):
    """/v1/completions: answers "The answer is 2." to the first ``budget`` requests, then HTTP 400."""

    def __init__(self, budget: int) -> None:
        self.budget, self.prompts = budget, collections.Counter()
        lock, server = threading.Lock(), self

        class Handler(JSONHandler):
            def do_POST(self):
                body = self.read_json()
                with lock:
                    server.prompts[body["prompt"]] += 1
                    ok = sum(server.prompts.values()) <= server.budget
                if not ok:
                    return self.send_json(400, {"error": "out of credit"})
                self.send_json(200, {"choices": [{"text": "The answer is 2."}]})

        self.start(Handler)


def _eval(url, out):
    proc = onepass("eval", "--data", "builtin:mathchat", "--limit", "2", "--backend", "openai", "--base-url", url,
                   "--model", "served", "--tokenizer", "builtin:qwen3", "--max-new-tokens", "8", "--batch-size", "1",
                   "--no-progress", "--out", str(out))
    text, _ = proc.communicate(timeout=180)
    return proc.returncode, text


@pytest.mark.e2e
def test_an_interrupted_eval_resumes_without_paying_twice(tmp_path):
    out = tmp_path / "eval"
    first = CountingServer(budget=3)
    try:
        rc, text = _eval(first.url, out)
    finally:
        first.close()
    assert rc == 2 and "out of credit" in text, text
    paid = [p for p, n in first.prompts.items() if n and list(first.prompts).index(p) < 3]
    cached = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(cached) == 3 == len(paid)

    second = CountingServer(budget=10**6)
    try:
        rc, text = _eval(second.url, out)
    finally:
        second.close()
    assert rc == 0, text
    assert not set(paid) & set(second.prompts), "a reply paid for in the first run was requested again"
    assert sum(second.prompts.values()) >= 1 and "3 replies cached" in text
    assert (out / "summary.json").is_file()
