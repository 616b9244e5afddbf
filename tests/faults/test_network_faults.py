"""Our one network client under a hostile endpoint (issue 24, item 1): a redirect to another origin never
carries the API key there, and its reply is never taken (``data augment`` and ``eval --backend openai``).

urllib follows a 302 to any host with every header of the request (``Authorization: Bearer ...``) and
turns the POST into a GET; requests/httpx drop the header across origins. An API endpoint that redirects
is a wrong base URL, so :mod:`onepass.data.chat_client` follows no redirect at all: one line naming where
it pointed, nothing sent there, nothing saved. Servers are on the loopback (``tests/local_server.py``).
"""

from __future__ import annotations

import json

import pytest
from fault_helpers import onepass
from local_server import Elsewhere, Redirector, conversation

KEY = "sk-live-0123456789abcdef"


@pytest.fixture(params=[302, 307])
def servers(request):
    elsewhere = Elsewhere()
    redirect = Redirector(elsewhere.url, request.param)
    yield redirect, elsewhere
    redirect.close()
    elsewhere.close()


def _one_error_line(text: str) -> str:
    errors = [line for line in text.splitlines() if line.startswith("onepass: error:")]
    assert len(errors) == 1 and "Traceback" not in text, text
    return errors[0]


@pytest.mark.e2e
def test_augment_follows_no_redirect_to_another_origin(tmp_path, servers):
    redirect, elsewhere = servers
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(conversation(0, ["ok"])) + "\n")
    out = tmp_path / "out.jsonl"
    proc = onepass("augment", "--data", str(data), "--out", str(out), "--base-url", redirect.url, "--model", "m",
                   "--timeout", "5", "--retries", "1", "--backoff", "0.01", "--api-key-env", "ONEPASS_TEST_KEY",
                   "--no-progress", env={"ONEPASS_TEST_KEY": KEY}, module="onepass.prepare.data_cli")
    text, _ = proc.communicate(timeout=60)
    assert elsewhere.seen == [], f"the request went on to another origin: {elsewhere.seen}"
    assert proc.returncode == 2, text
    assert "redirect" in _one_error_line(text) and KEY not in text
    assert not out.exists() or "from elsewhere" not in out.read_text()
    for written in tmp_path.rglob("*"):
        assert not written.is_file() or KEY not in written.read_text(errors="replace"), written


@pytest.mark.e2e
def test_eval_openai_follows_no_redirect_to_another_origin(tmp_path, servers):
    redirect, elsewhere = servers
    out = tmp_path / "eval"
    proc = onepass("eval", "--data", "builtin:mathchat", "--limit", "1", "--backend", "openai", "--base-url",
                   redirect.url, "--model", "served", "--tokenizer", "builtin:qwen3", "--max-new-tokens", "8",
                   "--no-progress", "--out", str(out), env={"OPENAI_API_KEY": KEY})
    text, _ = proc.communicate(timeout=120)
    assert elsewhere.seen == [], f"the request went on to another origin: {elsewhere.seen}"
    assert proc.returncode == 2, text
    assert "redirect" in _one_error_line(text) and KEY not in text
    for written in out.rglob("*") if out.exists() else []:  # the answer cache holds nothing from elsewhere
        assert not written.is_file() or written.read_text() == "", written


def test_a_redirect_is_refused_by_the_client_itself():
    from onepass.data.chat_client import ChatClient, ClientConfig, FatalRequestError

    elsewhere = Elsewhere()
    redirect = Redirector(elsewhere.url, 301)
    try:
        client = ChatClient(ClientConfig(base_url=redirect.url, model="m", timeout=5, retries=3, backoff=0))
        with pytest.raises(FatalRequestError, match="redirect"):
            client.complete_text("hi")
        assert redirect.hits == 1 and elsewhere.seen == []  # refused at once, not retried
    finally:
        redirect.close()
        elsewhere.close()
