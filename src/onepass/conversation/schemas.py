"""Record schemas: the shapes public datasets write conversations in, read as OpenAI messages.

Why this module exists: a conversation arrives as OpenAI/TRL ``messages``, ShareGPT
``conversations`` (LLaMA-Factory's ``function_call``/``observation`` speakers), Llama-Nemotron
``input``/``output``, or the paper's re-upload ``interactions``. Each shape becomes a list of
OpenAI message dicts here, every conversion named (:data:`CONVERSIONS`, counted in
``PrepareStats.conversions``); a record in a shape that is not a conversation (Alpaca,
prompt/completion, preference pairs) is one error naming it and the nearest supported schema.
A message's fields are read here too: reasoning (a field, or a leading ``<think>`` block), content
(a string, ``null``, content parts), OpenAI ``weight``, the ``system`` prompt in every form we accept
(:func:`system_field`), and text no tokenizer can take. A field onepass does not read is refused naming
it (:func:`unknown_fields`), never dropped: a template may render it at inference (``thought``, a
misspelled ``reasoning_contnet``), so dropping it would train another text than the model sees.
:mod:`onepass.conversation.parse` parses the messages.

    >>> where = Where(source="d.jsonl", index=1)
    >>> input_output({"input": "2+2?", "output": "4"}, where), where.conversions
    ([{'role': 'user', 'content': '2+2?'}, {'role': 'assistant', 'content': '4'}], ['input/output pair -> messages'])

Add a record schema: a reader here from the shape to OpenAI message dicts, each conversion it makes a
named constant added to :data:`CONVERSIONS` and recorded with ``where.converted`` (it is counted in
``stats.json``); its branch in :func:`onepass.conversation.parse.parse_record`, on the key that identifies
it; a hand-written record and the messages expected of it in ``tests/conversation/test_record_schemas.py``; a line in
docs/data.md ("Record schemas"). A near miss that is not a conversation is a row of ``_SCHEMAS``
instead: the error names it and the nearest supported schema.

No torch here: this is pure data.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from onepass.errors import ConversationError, message_at
from onepass.conversation.records import unique_keys

REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "name", "tool_call_id", "weight", "tools", *REASONING_KEYS})
"""The message fields onepass reads; any other with a value is refused naming it (:func:`unknown_fields`)."""
SHAREGPT_KEYS = frozenset({"from", "value", "role", "content", "weight", "tool_calls", "tools", *REASONING_KEYS})
INTERACTION_KEYS = frozenset({"query", "answer", "think"})
REASONING_ALIASES = ("thought", "thoughts", "think", "thinking_content", "reasoning_text", "chain_of_thought", "cot",
                     "rationale", "analysis", "scratchpad", "reflection", "reasoningContent", "reasoning_trace")
"""Keys other datasets put reasoning under: a message holding one is refused with the keys onepass reads."""
FIELD_HINTS = {"function_call": "OpenAI's legacy function_call: give it as tool_calls",
               "functions": "OpenAI's legacy functions: give them as tools"}
SYSTEM_KEYS = ("system", "system_prompt")  # system_prompt: Llama-Nemotron
RECORD_FIELDS = ("tools", *SYSTEM_KEYS)
"""Record fields whose near misses (``tool``, ``systems``, ``functions``) are refused: the template would
render them (the tool list, the system prompt) and onepass would not."""
MAX_DEPTH = 100
"""The deepest a record may nest (objects and lists): transformers and chat templates copy and print a
message recursively, one Python frame a level, so a record nested ~500 deep crashes rendering."""
_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")  # NUL or a lone surrogate (a pair is one code point in str)
_LEADING_THINK = re.compile(r"\s*<think>(.*?)</think>", re.DOTALL)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "system": "system", "tool": "tool", "function": "tool", "observation": "tool",
                  "function_call": "assistant"}  # LLaMA-Factory / glaive: the call as JSON in "value"
# What reading a record may convert (or leave out of every view), each named in PrepareStats.conversions
# (records converted so):
SHAREGPT_CALL = "sharegpt function_call turn -> assistant tool_calls"
HERMES_CALL = "inline <tool_call> JSON before a tool message -> tool_calls"
CONTENT_PARTS = "content [one text part] -> string"
CONTENT_NULL = "content null -> empty string"
SYSTEM_MESSAGE = "system field given as a message -> its content"
TRAILING = "messages after the last assistant turn -> in no view (never trained)"
INLINE_KEPT = "leading <think> block kept in the content (the template reads no reasoning field)"  # at render
GREETING = "assistant message opening the conversation (a greeting) -> context only, not trained (--train-greeting)"
# ^ at render: it answers no user turn (tau2-bench's agent greets first)
TAU2 = "tau2-bench messages -> OpenAI messages (turn_idx, timestamp, cost, usage: bookkeeping, left out)"
TAU2_USER_TOOLS = "tau2-bench user-side tool calls and results -> left out (the agent never saw them)"
INPUT_OUTPUT = "input/output pair -> messages"
NOT_TRAINED = "assistant weight 0 -> not trained"
FIELD_AND_INLINE = "reasoning field and a leading <think> block -> field, content kept"
CONVERSIONS = (SHAREGPT_CALL, HERMES_CALL, CONTENT_PARTS, CONTENT_NULL, INPUT_OUTPUT, NOT_TRAINED, FIELD_AND_INLINE,
               SYSTEM_MESSAGE, TRAILING, INLINE_KEPT, GREETING, TAU2, TAU2_USER_TOOLS)


@dataclass(frozen=True, kw_only=True, slots=True)
class Where:
    source: str
    index: int
    unit: str = "record"
    conversions: list[str] = field(default_factory=list)  # CONVERSIONS made reading this record, in order

    def converted(self, name: str) -> None:
        if name not in self.conversions:
            self.conversions.append(name)

    def __call__(self, msg: str, message: int | None = None) -> ConversationError:
        """The error naming the record (and message N), in the one wording of ``message_at``."""
        at = f"{self.source} {self.unit} {self.index}"
        return ConversationError(f"{at if message is None else message_at(at, message)}: {msg}")


def loads_json(text: str, what: str, where: Where, i: int | None = None, *, hint: str = "") -> Any:
    """``json.loads(text)``, or one error naming ``what``: not JSON, or nested deeper than :data:`MAX_DEPTH`
    (a string nested 100,000 deep is a RecursionError in Python's parser, never a traceback here)."""
    try:
        value = json.loads(text, object_pairs_hook=unique_keys, parse_constant=_not_a_number,
                           parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise where(f"{what} is not valid JSON ({e.msg})" + (f"; {hint}" if hint else ""), i) from None
    except ValueError as e:  # a key twice, NaN or a number past float's range: parsed, it would change silently
        raise where(f"{what}: {e}", i) from None
    except RecursionError:
        value = None
        depth = MAX_DEPTH + 1
    else:
        depth = nesting(value)
    if depth > MAX_DEPTH:
        raise where(f"{what} is JSON nested more than {MAX_DEPTH} levels deep (chat templates and transformers "
                    "copy and print it one level at a time)", i)
    return value


def _not_a_number(name: str) -> float:
    raise ValueError(f"{name} is not JSON (a template would print it as {name} or null, not the record's text)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is past a float's range (it would be rendered as Infinity)")
    return value


def finite_numbers(value: Any) -> str | None:
    """The first number in ``value`` (nested) that is NaN or infinite, as text (None when there is none): a
    record's tool-call arguments given as an object are rendered by the template's ``tojson``, which prints
    ``NaN`` / ``Infinity``, not JSON, and not what the model would emit.

    >>> finite_numbers({"a": [1.5, float("nan")]}), finite_numbers({"a": 1})
    ('nan', None)
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return repr(item)
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


def nesting(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deep ``value`` nests (objects and lists; a scalar is 0), counted up to ``limit + 1`` without recursion.

    >>> nesting({"a": [1, {"b": []}]}), nesting("x")
    (4, 0)
    """
    deepest, stack = 0, [(value, 0)]
    while stack and deepest <= limit:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, tuple, Mapping)) and not value)


def _hint(key: str, known: frozenset[str]) -> str:
    """Why ``key`` may be meant as a field onepass reads: a reasoning alias, a legacy OpenAI name, a near miss."""
    if key in FIELD_HINTS:
        return FIELD_HINTS[key]
    reasoning = [k for k in (*REASONING_KEYS, "think") if k in known]  # think: the interactions schema's
    if reasoning and (key.lower() in REASONING_ALIASES or difflib.get_close_matches(key, reasoning, n=1, cutoff=0.7)):
        return f"did you mean {reasoning[0]}? onepass reads reasoning from {', '.join(reasoning)}"
    near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return f"did you mean {near[0]}?" if near else ""


def unknown_fields(raw: Mapping[str, Any], known: frozenset[str], where: Where, i: int | None,
                   what: str = "field") -> None:
    """Refuse the fields of ``raw`` that onepass does not read and that hold something (null or empty is
    nothing to lose: a parquet column of another record's field), naming them, with a hint for a near miss.

    >>> unknown_fields({"role": "assistant", "thought": "2+2=4"}, MESSAGE_KEYS, Where(source="d.jsonl", index=3), 1)
    Traceback (most recent call last):
    ...
    onepass.errors.ConversationError: d.jsonl record 3, message 1: unknown field 'thought' (did you mean \
reasoning_content? onepass reads reasoning from reasoning_content, reasoning, thinking); onepass reads \
content, name, reasoning, reasoning_content, role, thinking, tool_call_id, tool_calls, tools, weight: rename or \
remove it (a template may render it at inference, so onepass will not drop it)
    """
    unknown = [str(k) for k, v in raw.items() if k not in known and not _empty(v)]
    if not unknown:
        return
    named = ", ".join(repr(k) + (f" ({h})" if (h := _hint(k, known)) else "") for k in unknown)
    raise where(f"unknown {what}{'s' if len(unknown) > 1 else ''} {named}; onepass reads {', '.join(sorted(known))}: "
                "rename or remove it (a template may render it at inference, so onepass will not drop it)", i)


def record_fields(record: Mapping[str, Any], where: Where) -> None:
    """Refuse a record field that is a near miss of one onepass reads (``tool``, ``functions``, ``systems``):
    the template would render it and onepass would not. Other fields (``id``, ``source``) are metadata."""
    for key, value in record.items():
        if key in RECORD_FIELDS or _empty(value) or not isinstance(key, str):
            continue
        near = ("tools" if key == "functions" else
                next(iter(difflib.get_close_matches(key, RECORD_FIELDS, n=1, cutoff=0.85)), None))
        shaped = (isinstance(value, list) and all(isinstance(t, Mapping) for t in value) if near == "tools"
                  else isinstance(value, (str, list, Mapping)))  # what that field holds: metadata is let be
        if near is not None and shaped:
            raise where(f"unknown record field {key!r} (did you mean {near}?): onepass reads the tool list from "
                        "'tools' and the system prompt from 'system' or 'system_prompt', so it would not be "
                        "rendered; rename or remove it")


def system_field(record: Mapping[str, Any], where: Where) -> tuple[str | None, str]:
    """The system prompt given as a record field, and its role (``system``, or ``developer`` for a developer
    message): ``system`` or ``system_prompt`` (Llama-Nemotron), as a string, a list of one text part, or a
    system message ``{"role": "system", "content": ...}``. Blank or null is none; both fields holding
    different text, or any other value (a number), is an error: a system prompt is never dropped silently.

    >>> system_field({"system": None, "system_prompt": "Be brief."}, Where(source="d", index=0))
    ('Be brief.', 'system')
    >>> system_field({"system": [{"type": "text", "text": "Be brief."}]}, Where(source="d", index=0))
    ('Be brief.', 'system')
    """
    given: dict[str, str] = {}
    role = "system"
    for key in SYSTEM_KEYS:
        value = record.get(key)
        if isinstance(value, Mapping):
            unknown_fields(value, frozenset({"role", "content"}), where, None, what=f"field of '{key}'")
            if value.get("role", "system") not in ("system", "developer"):
                raise where(f"'{key}' is a {value.get('role')!r} message; a system prompt is a string or a "
                            "system message")
            role = value.get("role", "system")
            where.converted(SYSTEM_MESSAGE)
            value = value.get("content")
        if value is None:
            continue
        if isinstance(value, list):
            value = message_content({"content": value}, "system", (), where, None, what=f"'{key}'")
        if not isinstance(value, str):
            raise where(f"'{key}' must be a string, a list of one text part or a system message, "
                        f"got {type(value).__name__} {value!r:.40}")
        if value.strip():
            given[key] = value
    if len(set(given.values())) > 1:
        raise where("'system' and 'system_prompt' hold different text: keep one (onepass will not guess which)")
    return next(iter(given.values()), None), role


def _sharegpt_call(value: Any, where: Where, i: int) -> dict[str, Any]:
    """A ShareGPT ``function_call`` turn (LLaMA-Factory, glaive): ``value`` is the call as JSON,
    ``{"name": ..., "arguments": {...}}`` or a list of them -> an assistant message with tool_calls."""
    calls = (loads_json(value, "a function_call turn's value", where, i,
                        hint='LLaMA-Factory writes {"name": ..., "arguments": {...}}')
             if isinstance(value, str) else None)
    calls = [calls] if isinstance(calls, Mapping) else calls
    if not isinstance(calls, list) or not calls:
        raise where('a function_call turn\'s value must be a JSON {"name": ..., "arguments": ...} or a list of them', i)
    where.converted(SHAREGPT_CALL)
    return {"role": "assistant", "content": "", "tool_calls": calls}


def sharegpt(raw: list[Any], where: Where) -> list[dict[str, Any]]:
    out = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, Mapping):
            raise where(f"a turn must be an object, got {type(turn).__name__}", i)
        unknown_fields(turn, SHAREGPT_KEYS, where, i)
        who = turn.get("from", turn.get("role"))
        if who not in SHAREGPT_ROLES:
            raise where(f"unknown speaker {who!r}; expected one of {', '.join(SHAREGPT_ROLES)}", i)
        value = turn.get("value", turn.get("content"))
        if who == "function_call":
            out.append(_sharegpt_call(value, where, i) | ({"tools": turn["tools"]} if "tools" in turn else {}))
            continue
        msg = {"role": SHAREGPT_ROLES[who], "content": value}
        for key in (*REASONING_KEYS, "weight", "tool_calls", "tools"):
            if key in turn:
                msg[key] = turn[key]
        out.append(msg)
    return out


def input_output(record: Mapping[str, Any], where: Where) -> list[Any]:
    """An ``input``/``output`` pair (Llama-Nemotron post-training: ``input`` a list of messages, or one
    user text; ``output`` the answer, reasoning inline) -> messages ending with the assistant's."""
    given, output = record["input"], record["output"]
    if not isinstance(output, str):
        raise where(f"'output' must be a string (the assistant's answer), got {type(output).__name__}")
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    if not isinstance(given, list):
        raise where(f"'input' must be a list of messages or a string, got {type(given).__name__}")
    where.converted(INPUT_OUTPUT)
    return [*given, {"role": "assistant", "content": output}]


_SCHEMAS = (  # (keys a record has, what it is, the nearest supported schema)
    (("instruction", "output"), "an Alpaca instruction/input/output record",
     "'input'/'output' (the user text and the answer) or 'messages'; an instruction and an input joined "
     "into one prompt is the data's choice"),
    (("prompt", "completion"), "a prompt/completion record", "'messages' (user, then assistant)"),
    (("chosen", "rejected"), "a preference (chosen/rejected) record", "'messages' of the chosen conversation"),
    (("text",), "a plain-text record", "'messages' (a chat template renders them)"),
    (("question", "answer"), "a question/answer record", "'input'/'output' or 'messages'"),
)


def unknown_schema(record: Mapping[str, Any], where: Where) -> ConversationError:
    keys = ", ".join(sorted(map(str, record)))
    for needed, what, nearest in _SCHEMAS:
        if all(k in record for k in needed):
            return where(f"{what} (keys {keys}), not a conversation; the nearest supported schema: {nearest}")
    return where("no 'messages', 'conversations', 'interactions' or 'input'/'output' field; keys are " + keys)


def interactions(raw: list[Any], where: Where) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, Mapping) or "query" not in turn or "answer" not in turn:
            raise where("an interaction must be an object with 'query', 'answer' (and 'think')", i)
        unknown_fields(turn, INTERACTION_KEYS, where, i)
        out.append({"role": "user", "content": turn["query"]})
        out.append({"role": "assistant", "content": turn["answer"], "reasoning": turn.get("think")})
    return out


def leading_reasoning(content: str) -> tuple[str | None, str]:
    """A record's inline reasoning: a ``<think>...</think>`` block that *opens* the content (after
    optional whitespace) -> (reasoning, the rest); anything else -> (None, content): a tag in the middle
    of an answer is answer text ("models such as R1 emit <think>...</think> first"). A content that
    closes ``</think>`` with no ``<think>`` before it is an R1-style output whose generation prompt
    opened the block: what precedes the tag is reasoning.

    >>> leading_reasoning("\\n<think>\\nr\\n</think>\\n\\na")
    ('r', 'a')
    >>> leading_reasoning("Sure! R1 emits <think>x</think> and then")
    (None, 'Sure! R1 emits <think>x</think> and then')
    """
    found = _LEADING_THINK.match(content)
    if found is not None:
        return found.group(1).strip("\n"), content[found.end():].lstrip("\n")
    head, closed, tail = content.partition("</think>")
    if closed and "<think>" not in head:  # R1-style output: the generation prompt opened <think>
        return head.strip("\n"), tail.lstrip("\n")
    return None, content


def text_field(value: Any, what: str, where: Where, i: int | None, *, allow_none: bool = False) -> str:
    if value is None and allow_none:
        return ""
    if not isinstance(value, str):
        raise where(f"{what} must be a string, got {type(value).__name__}", i)
    return value


def bad_text(value: Any, path: str = "") -> str | None:
    """Where in ``value`` (nested dicts/lists) a string holds a NUL or a lone surrogate, or None.

    >>> print(bad_text({"messages": [{"content": "ok"}, {"content": "a\\ud800b"}]}))
    messages[1].content: a lone surrogate U+D800 at character 1 (not encodable as UTF-8)
    >>> bad_text({"content": "fine"}) is None
    True
    """
    if isinstance(value, str):
        found = _BAD_TEXT.search(value)
        if found is None:
            return None
        ch = found.group()
        what = "a NUL character" if ch == "\x00" else f"a lone surrogate U+{ord(ch):04X}"
        return (f"{path or 'text'}: {what} at character {found.start()}"
                + ("" if ch == "\x00" else " (not encodable as UTF-8)"))
    if isinstance(value, Mapping):
        for k, v in value.items():
            key = str(k)
            if _BAD_TEXT.search(key):
                return f"{path or 'record'}: a key holds a NUL or a lone surrogate"
            found = bad_text(v, f"{path}.{key}" if path else key)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            found = bad_text(v, f"{path}[{j}]")
            if found:
                return found
    return None


def check_text(record: Mapping[str, Any], where: Where) -> None:
    """Refuse a record nested deeper than :data:`MAX_DEPTH`, or with a string no tokenizer can encode,
    naming the message it is in."""
    if nesting(record) > MAX_DEPTH:
        listed = next((record[k] for k in ("messages", "conversations", "interactions")
                       if isinstance(record.get(k), list)), [])
        deep = next((j for j, m in enumerate(listed) if nesting(m) > MAX_DEPTH - 2), None)
        raise where(f"nested more than {MAX_DEPTH} levels deep (chat templates and transformers copy and print "
                    "a message one level at a time)", deep)
    found = bad_text(record)
    if found is None:
        return
    m = re.match(r"(messages|conversations|interactions)\[(\d+)\]", found)
    raise where(f"{found}", int(m.group(2)) if m else None)


def reasoning_field(raw: Mapping[str, Any], where: Where, i: int) -> str | None:
    """The reasoning of an assistant message; several fields must agree (none is dropped silently)."""
    given = {key: text_field(raw[key], key, where, i) for key in REASONING_KEYS if raw.get(key) is not None}
    if len(set(given.values())) > 1:
        raise where("conflicting reasoning fields " + ", ".join(given)
                    + " hold different text: keep one (onepass will not guess which)", i)
    return next(iter(given.values()), None)


def message_content(raw: Mapping[str, Any], role: str, calls: tuple[Any, ...], where: Where, i: int | None,
                    what: str = "content") -> str:
    """The message's text: a string; ``null`` -> "" (counted, but for a tool-call turn, where OpenAI
    writes it); a list of content parts holding one text part -> its text (counted); else an error."""
    value = raw.get("content")
    if value is None:
        if not (role == "assistant" and calls):
            where.converted(CONTENT_NULL)
        return ""
    if isinstance(value, list):
        kinds = [p.get("type") if isinstance(p, Mapping) else type(p).__name__ for p in value]
        if kinds == ["text"] and isinstance(value[0].get("text"), str):
            where.converted(CONTENT_PARTS)
            return value[0]["text"]
        raise where(f"{what} is a list of {len(value)} OpenAI content parts ({', '.join(map(str, kinds)) or 'none'}): "
                    "onepass reads a string or a list of one text part; join the text into one string "
                    "(how parts are joined is the data's choice, so onepass will not guess)", i)
    return text_field(value, what, where, i)


def trains(raw: Mapping[str, Any], role: str, where: Where, i: int) -> bool:
    """OpenAI fine-tuning ``"weight"``: 0 = in the context only, never trained; 1 (or absent) = trained."""
    weight = raw.get("weight")
    if weight is None:
        return True
    if isinstance(weight, bool) or weight not in (0, 1):
        raise where(f"weight must be 0 or 1 (OpenAI fine-tuning format), got {weight!r}", i)
    if role != "assistant" and weight == 1:
        raise where(f"weight 1 on a {role} message: only assistant messages are trained", i)
    if role == "assistant" and weight == 0:
        where.converted(NOT_TRAINED)
    return weight == 1 or role != "assistant"
