"""A JSON HTTP server on 127.0.0.1 (an ephemeral port) for the tests of OpenAI-compatible clients
(tests/data/test_data_augment.py, tests/faults/test_augment_faults.py, tests/evaluate/test_eval.py),
and :class:`FakeOpenAI`, the chat-completions server of the augment tests. Traffic stays on the loopback."""

from __future__ import annotations

import collections
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JSONHandler(BaseHTTPRequestHandler):
    """A request handler that reads and writes JSON and keeps the test output clean."""

    def log_message(self, *args):
        pass

    def read_json(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class LocalServer:
    """Serves ``handler`` in a daemon thread; ``url`` is the ``/v1`` base a client is given."""

    def start(self, handler: type[JSONHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


REPLY_MARK = "The assistant's reply:\n"
REFUSAL = "I'm sorry, but I can't help with that."


class FakeOpenAI(LocalServer):
    """Chat-completions for ``onepass data augment``. The behaviour of a request is chosen by the tag in the
    reply it asks about: ``[ok]``, ``[500once]``, ``[hangonce]``, ``[badjsononce]``, ``[always500]``,
    ``[400]``, ``[401]``, ``[refuse]`` / ``[refuseonce]`` (a refusal in the requested JSON),
    ``[echo500]`` / ``[echo401]`` / ``[echojson]`` / ``[echoreason]`` (the request's auth header echoed
    back in an error body, in a reply that is not JSON, or in the reasoning itself). ``received`` counts requests per augment key, ``log`` keeps
    their order."""

    def __init__(self, *, delay: float = 0.0, hang: float = 1.0) -> None:
        from onepass.data.augment import request_key

        self.received: collections.Counter[str] = collections.Counter()
        self.log: list[str] = []
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
                    server.log.append(key)
                    attempt = server.received[key]
                try:
                    server.respond(self, tag, attempt, reply)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout): fine

        self.delay, self.hang = delay, hang
        self.start(Handler)

    def respond(self, h: JSONHandler, tag: str, attempt: int, reply: str) -> None:
        echo = f"Authorization: {h.headers.get('Authorization')}"
        if tag == "always500" or (tag == "500once" and attempt == 1):
            return h.send_json(500, {"error": "boom"})
        if tag in ("400", "401"):
            return h.send_json(int(tag), {"error": "no"})
        if tag in ("echo500", "echo401"):
            return h.send_json(int(tag[4:]), {"error": f"bad request, headers were {echo}"})
        if tag == "hangonce" and attempt == 1:
            time.sleep(self.hang)
        time.sleep(self.delay)
        reasoning = f"I think about {json.loads(reply)['content']}"
        if tag == "refuse" or (tag == "refuseonce" and attempt == 1):
            reasoning = REFUSAL
        elif tag == "echoreason":
            reasoning = f"I think about the request; {echo}"
        content = json.dumps({"reasoning": reasoning})
        if tag == "badjsononce" and attempt == 1:
            content = "this is not JSON"
        elif tag == "echojson":
            content = f"cannot parse your request; {echo}"
        h.send_json(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})


def conversation(i: int, tags: list[str]) -> dict:
    """Record ``c{i}`` with one user/assistant pair per tag; the tag picks :class:`FakeOpenAI`'s answer."""
    messages = []
    for k, tag in enumerate(tags):
        messages += [{"role": "user", "content": f"question {i}.{k}"},
                     {"role": "assistant", "content": f"answer {i}.{k} [{tag}]"}]
    return {"id": f"c{i}", "messages": messages}


class Elsewhere(LocalServer):
    """Another origin (another port): records every request's method, path and ``Authorization`` header and
    answers with a (chat-)completion whose text is ``reply``: what a client that follows a redirect would take."""

    def __init__(self, reply: str = '{"reasoning": "from elsewhere"}') -> None:
        self.seen: list[tuple[str, str, str | None]] = []
        server = self

        class Handler(JSONHandler):
            def answer(self):
                server.seen.append((self.command, self.path, self.headers.get("Authorization")))
                self.send_json(200, {"choices": [{"index": 0, "text": reply,
                                                  "message": {"role": "assistant", "content": reply}}]})

            do_GET = do_POST = answer

        self.start(Handler)


class Redirector(LocalServer):
    """Answers every POST with ``status`` and a ``Location`` on ``target`` (same path)."""

    def __init__(self, target: str, status: int = 302) -> None:
        self.hits = 0
        server = self

        class Handler(JSONHandler):
            def do_POST(self):
                server.hits += 1
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(status)
                self.send_header("Location", target.rsplit("/v1", 1)[0] + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.start(Handler)
