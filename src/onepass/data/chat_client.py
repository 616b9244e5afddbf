"""A minimal OpenAI-compatible chat-completions client: stdlib only, retries, timeouts.

Why this module exists: ``onepass data augment`` sends tens of thousands of
requests to an endpoint (OpenAI, vLLM, SGLang, llama.cpp, ...) and must
survive the usual trouble: 429 and 5xx answers, a server that never answers,
a reply that is not the JSON we asked for. One request, one function:
:meth:`ChatClient.complete_json` returns the parsed JSON object or raises
:class:`RequestFailed` after its retries, saying why; nothing else is
imported (no SDK, no httpx) so the package stays light.

Retry policy: network errors, timeouts, HTTP 408/409/429/5xx and replies
that are not the expected JSON are retried up to ``retries`` times, waiting
``min(max_backoff, backoff * 2**attempt)`` seconds (times a random factor in
[0.5, 1], or the server's ``Retry-After`` when it sends one, capped the same
way). Other 4xx answers fail at once; 401/403/404 raise :class:`FatalRequestError`
because no later request can succeed either.

Redirects are never followed: ``urllib`` would follow a 302 to any host with the
``Authorization`` header (the API key) and turn the POST into a body-less GET whose
reply we would accept. An API endpoint that redirects is a wrong base URL, so a
redirect raises :class:`FatalRequestError` naming where it pointed (every command
that talks to an endpoint, ``data augment`` and ``eval --backend openai``, uses this
one client).

Example (a local server)::

    client = ChatClient(ClientConfig(base_url="http://127.0.0.1:8000/v1", model="m"))
    client.complete_json([{"role": "user", "content": "..."}], required="reasoning")
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from onepass.errors import ConfigError, UsageError

RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
# A credential in text a server sent back (an echoed header, a URL): the name and separator are kept.
_SECRET_HEADER = re.compile(r"""(?i)(\b(?:proxy-)?authorization|\bx-(?:goog-)?api-key|\bapi[-_]key)(["']?\s*[:=]\s*["']?)"""
                            r"""((?:bearer|basic|token)\s+)?[^\s"',;&}\]]+""")
_SECRET_BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{6,}")
_SECRET_QUERY = re.compile(r"""(?i)([?&](?:key|api[-_]?key|access[-_]token|token|auth|sig|signature)=)[^&\s"'#]+""")
FATAL_STATUS = frozenset({401, 403, 404})
_FENCE = re.compile(r"^\s*```(?:json)?\s*\n?(.*?)\n?```\s*$", re.DOTALL)


class RequestFailed(RuntimeError):
    """A request that failed after its retries; ``attempts`` and the last ``error`` say why."""

    def __init__(self, error: str, attempts: int) -> None:
        super().__init__(f"{error} (after {attempts} attempt{'s' if attempts != 1 else ''})")
        self.error, self.attempts = error, attempts


class FatalRequestError(ConfigError):
    """The endpoint refuses every request (bad key, unknown model or URL): stop the run."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuses every redirect: it must not carry the key to another origin, nor turn a POST into a GET."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201 (urllib's API)
        raise FatalRequestError(f"{scrub(req.full_url)} answered HTTP {code} (a redirect to {scrub(newurl)}); "
                                "redirects are not followed (they would carry the API key elsewhere): give the "
                                "final URL as the base URL")


_OPENER = urllib.request.build_opener(_NoRedirect)


class _Retryable(Exception):
    def __init__(self, message: str, wait: float | None = None) -> None:
        super().__init__(message)
        self.wait = wait


@dataclass(frozen=True, kw_only=True, slots=True)
class ClientConfig:
    base_url: str
    model: str
    api_key_env: str = "OPENAI_API_KEY"
    temperature: float = 0.1
    max_tokens: int | None = None
    timeout: float = 120.0  # seconds per socket operation (connect, each read)
    retries: int = 5
    backoff: float = 1.0
    max_backoff: float = 60.0
    json_mode: bool = True  # send response_format {"type": "json_object"}

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise UsageError(f"base URL must start with http:// or https://, got {self.base_url!r}")
        if self.timeout <= 0 or self.retries < 0 or self.backoff < 0 or self.max_backoff < 0:
            raise UsageError("timeout must be > 0; retries, backoff and max_backoff >= 0")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) or None


def scrub(text: str, secret: str | None = None) -> str:
    """``text`` with credentials masked: the API key itself, the value of an ``Authorization`` /
    ``x-api-key`` / ``api-key`` header, a ``Bearer`` token and a ``?key=`` (``token=``, ...) query
    parameter. A server may echo any of these into an error, which we print and write.

    >>> scrub("401: bad header 'Bearer sk-123'", "sk-123")
    "401: bad header 'Bearer ***'"
    >>> scrub('echo {"x-api-key": "k9", "url": "https://h/v1?key=abc&alt=json"}')
    'echo {"x-api-key": "***", "url": "https://h/v1?key=***&alt=json"}'
    """
    if secret:
        text = text.replace(secret, "***")
    text = _SECRET_HEADER.sub(lambda m: m.group(1) + m.group(2) + (m.group(3) or "") + "***", text)
    text = _SECRET_BEARER.sub(r"\1***", text)
    return _SECRET_QUERY.sub(r"\1***", text)


def parse_json_reply(text: str, required: str, aliases: Sequence[str] = ()) -> str:
    """The non-empty string under ``required`` (or an alias) in a JSON object reply; ``ValueError`` else.

    A reply wrapped in a Markdown code fence is accepted.
    """
    m = _FENCE.match(text)
    body = m.group(1) if m else text
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"reply is not JSON ({e.msg}): {text[:80]!r}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"reply is JSON but not an object: {text[:80]!r}")
    for key in (required, *aliases):
        value = obj.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    raise ValueError(f"reply has no non-empty string {required!r}; keys: {', '.join(map(str, obj)) or 'none'}")


class ChatClient:
    """Thread-safe (one ``urllib`` request per call, no shared connection state).

    Every error it raises has credentials masked (:func:`scrub`): its messages end up in
    failure reports, logs and the one-line error a command prints.
    """

    def __init__(self, config: ClientConfig, *, sleep: Callable[[float], None] = time.sleep) -> None:
        self.config = config
        self._sleep = sleep
        self._key = config.api_key()

    def _body(self, messages: Sequence[dict[str, str]]) -> bytes:
        body: dict[str, Any] = {"model": self.config.model, "messages": list(messages),
                                "temperature": self.config.temperature}
        if self.config.max_tokens is not None:
            body["max_tokens"] = self.config.max_tokens
        if self.config.json_mode:
            body["response_format"] = {"type": "json_object"}
        return json.dumps(body, ensure_ascii=False).encode("utf-8")

    def _post(self, body: bytes, url: str | None = None) -> str:
        url = url or self.config.url
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with _OPENER.open(request, timeout=self.config.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:200].decode("utf-8", "replace") if e.fp is not None else ""
            detail, url = scrub(detail, self._key), scrub(url, self._key)
            if e.code in FATAL_STATUS:
                raise FatalRequestError(f"{url} answered HTTP {e.code}: {detail}; check the "
                                        f"base URL, the model name and ${self.config.api_key_env}") from None
            if e.code in RETRY_STATUS or e.code >= 500:
                raise _Retryable(f"HTTP {e.code}: {detail}", _retry_after(e.headers)) from None
            raise RequestFailed(f"HTTP {e.code}: {detail}", 1) from None
        except TimeoutError:  # socket.timeout is TimeoutError
            raise _Retryable(f"timed out after {self.config.timeout:g}s") from None
        except http.client.HTTPException as e:  # IncompleteRead, BadStatusLine, ...
            raise _Retryable(f"broken HTTP response: {e!r}") from None
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise _Retryable(f"timed out after {self.config.timeout:g}s") from None
            raise _Retryable(f"connection error: {reason}") from None
        try:
            choice = json.loads(raw)["choices"][0]
            content = choice["message"]["content"] if "message" in choice else choice["text"]  # chat | completions
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise _Retryable(f"not a (chat-)completions response: {raw[:80]!r}") from None
        if not isinstance(content, str):
            raise _Retryable(f"the message content is {type(content).__name__}, not text")
        return content

    def complete_json(self, messages: Sequence[dict[str, str]], *, required: str, aliases: Sequence[str] = (),
                      check: Callable[[str], None] | None = None) -> tuple[str, int]:
        """``(value of required, attempts used)``; raises :class:`RequestFailed` after the retries.

        ``check(value)`` may raise ``ValueError`` to reject a reply that parses (a refusal): the
        attempt counts as failed and is retried like a reply that is not the JSON asked for.
        """
        def parse(text: str) -> str:
            value = parse_json_reply(text, required, aliases)
            if check is not None:
                check(value)
            return value

        return self._retrying(self._body(messages), parse)

    def complete_text(self, prompt: str | None = None, *, messages: Sequence[dict[str, Any]] | None = None
                      ) -> tuple[str, int]:
        """``(reply text, attempts used)``, unparsed, with the same retries.

        A raw ``prompt`` goes to ``/completions`` (the server applies no chat template: the prompt is
        already rendered); ``messages`` go to ``/chat/completions`` like :meth:`complete_json`.
        """
        if (prompt is None) == (messages is None):
            raise UsageError("complete_text takes exactly one of prompt or messages")
        if messages is not None:
            return self._retrying(self._body(messages), lambda text: text)
        body: dict[str, Any] = {"model": self.config.model, "prompt": prompt, "temperature": self.config.temperature}
        if self.config.max_tokens is not None:
            body["max_tokens"] = self.config.max_tokens
        url = self.config.base_url.rstrip("/") + "/completions"
        return self._retrying(json.dumps(body, ensure_ascii=False).encode("utf-8"), lambda text: text, url)

    def _retrying(self, body: bytes, parse: Callable[[str], str], url: str | None = None) -> tuple[str, int]:
        attempts = self.config.retries + 1
        error = ""
        for attempt in range(attempts):
            wait = None
            try:
                return parse(self._post(body, url)), attempt + 1
            except _Retryable as e:
                error, wait = scrub(str(e), self._key), e.wait
            except ValueError as e:
                if isinstance(e, FatalRequestError):
                    raise
                error = scrub(str(e), self._key)
            except RequestFailed as e:
                raise RequestFailed(scrub(e.error, self._key), attempt + 1) from None
            if attempt + 1 < attempts:
                delay = min(self.config.max_backoff, self.config.backoff * 2 ** attempt)
                self._sleep(min(self.config.max_backoff, wait) if wait is not None
                            else delay * (0.5 + random.random() / 2))
        raise RequestFailed(error, attempts)  # error is scrubbed


def _retry_after(headers: Any) -> float | None:
    try:
        value = float(headers.get("Retry-After")) if headers is not None else None
    except (TypeError, ValueError):
        return None
    return value if value is not None and value >= 0 else None
