"""The tool schemas rendered once per distinct value, where the chat template allows it.

Why this module exists: agent data hands the same tools (tau-bench: 14 schemas, 2.5k tokens) to the
chat template for every prompt of every conversation, and the template turns them into JSON each time
(``tool | tojson`` per tool, per render): about 40% of rendering a tau-bench view. A template whose
output depends on ``tools`` only through one loop over them, the loop's body reading nothing but the
tool and the loop's own state, renders the same block of text for the same tools wherever they
appear. So the block is rendered once per distinct value, and every other render hands the template
small stand-in tools (the same number, names that occur nowhere else) and puts the real block in
place of the stand-ins' block::

    render(messages, tools=[t1 .. t14])                      ~ 1.0 ms
    render(messages, tools=[s1 .. s14]).replace(S, T)        ~ 0.6 ms   (S, T: the two blocks)

Which templates allow it is read off the template's syntax tree (:func:`allows`): ``tools`` appears
only as a truth value, a length, ``is defined``-style tests, and as the iterable of exactly one
``for`` loop that no other loop or macro holds, whose body loads no name but its target and
``loop``. The two blocks are the difference between two renders of a probe conversation (one user
message) with the real and the stand-in tools; a render is used only when the stand-in block occurs
in it exactly once, and the first render of each distinct value is checked against the plain one
(any difference: the plain render from then on). Everything else renders as it always did.

No torch here: this is pure data.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CACHED = 32  # distinct (template, tools) values kept per tokenizer


@dataclass(kw_only=True)
class ToolsBlock:
    """The stand-in tools for one (template, tools) value and the two blocks of text, or ``usable``
    False where the template does not allow the substitution."""

    usable: bool
    stand_in: list[dict[str, Any]] = field(default_factory=list)
    stand_in_text: str = ""
    text: str = ""
    checked: bool = False  # the first render through it was compared with the plain one


_blocks: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[str, str], ToolsBlock]] = weakref.WeakKeyDictionary()
_allowed: dict[str, bool] = {}
_values: OrderedDict[tuple[int, ...], tuple[tuple[Any, ...], str]] = OrderedDict()  # tool dicts by id -> JSON


def allows(template: str) -> bool:
    """Whether ``template``'s output depends on ``tools`` only through one loop over them (module doc)."""
    if template not in _allowed:
        _allowed[template] = _allows(template)
        while len(_allowed) > CACHED:
            _allowed.pop(next(iter(_allowed)))
    return _allowed[template]


def _allows(template: str) -> bool:
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        tree = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols]).parse(template)
    except jinja2.TemplateError:  # an extension tag the plain parser does not know: render as it is
        return False
    loops: list[Any] = []

    def visit(node: Any, parent: Any, held: bool, truth: bool) -> bool:
        """``held``: inside a loop or macro; ``truth``: the node's value is used only as a truth value."""
        if isinstance(node, nodes.Name) and node.name == "tools" and node.ctx == "load":
            if isinstance(parent, nodes.For) and parent.iter is node:
                loops.append((parent, held))
                return True
            return truth or isinstance(parent, nodes.Test) or (isinstance(parent, nodes.Filter)
                                                                and parent.name == "length")
        inside = held or isinstance(node, (nodes.For, nodes.Macro, nodes.CallBlock))
        for child in node.iter_child_nodes():
            as_truth = ((isinstance(node, (nodes.If, nodes.CondExpr)) and child is node.test)
                        or isinstance(node, nodes.Not) or (isinstance(node, (nodes.And, nodes.Or)) and truth))
            if not visit(child, node, held if child is getattr(node, "iter", None) else inside, as_truth):
                return False
        return True

    if not visit(tree, None, False, False) or len(loops) != 1:
        return False
    loop, held = loops[0]
    if held or loop.recursive or loop.else_ or loop.test is not None or not isinstance(loop.target, nodes.Name):
        return False
    own = {loop.target.name, "loop"}
    for part in loop.body:
        for name in part.find_all(nodes.Name):
            if name.ctx == "load" and name.name not in own:
                return False
            if name.ctx == "store":
                own.add(name.name)
        if any(True for _ in part.find_all(nodes.NSRef)):
            return False
    return True


def _value(tools: list[dict[str, Any]]) -> str:
    """The tools as JSON, computed once for the same tool objects (a conversation's renders share them)."""
    key = tuple(id(t) for t in tools)
    hit = _values.get(key)
    if hit is None:
        hit = (tuple(tools), json.dumps(tools, sort_keys=True, ensure_ascii=False, default=str))
        _values[key] = hit  # holds the objects, so their ids stay theirs
        while len(_values) > CACHED:
            _values.popitem(last=False)
    else:
        _values.move_to_end(key)
    return hit[1]


def _stand_in(value: str, n: int) -> list[dict[str, Any]]:
    mark = "onepass_tools_" + hashlib.blake2b(value.encode(), digest_size=8).hexdigest()
    return [{"type": "function", "function": {"name": f"{mark}_{i}", "description": f"{mark}_{i}",
                                              "parameters": {"type": "object", "properties": {}}}}
            for i in range(n)]


Render = Callable[[list[dict[str, Any]], list[dict[str, Any]]], Any]
"""``render(messages, tools)``: the template's plain output (:func:`onepass.render.template.apply_template`'s call)."""


def tools_block(tokenizer: Any, template: str | None, tools: list[dict[str, Any]], render: Render
                ) -> ToolsBlock | None:
    """The :class:`ToolsBlock` of ``tools`` under ``template`` (the text the tokenizer renders with;
    probed with ``render``, the call with the render's keyword arguments), or None where there is none
    to use."""
    if not isinstance(template, str) or not tools or not allows(template):
        return None
    try:
        blocks = _blocks.setdefault(tokenizer, OrderedDict())
    except TypeError:  # not weak-referenceable
        return None
    key = (template, _value(tools))
    block = blocks.get(key)
    if block is None:
        block = _probe(tools, key[1], render)
        blocks[key] = block
        while len(blocks) > CACHED:
            blocks.popitem(last=False)
    else:
        blocks.move_to_end(key)
    return block if block.usable else None


def _probe(tools: list[dict[str, Any]], value: str, render: Render) -> ToolsBlock:
    stand_in = _stand_in(value, len(tools))
    probe = [{"role": "user", "content": "x"}]
    try:
        real, fake = render(probe, tools), render(probe, stand_in)
    except Exception:  # the template raises for the probe: render as it is
        return ToolsBlock(usable=False)
    if not isinstance(real, str) or not isinstance(fake, str):
        return ToolsBlock(usable=False)
    head = 0
    while head < min(len(real), len(fake)) and real[head] == fake[head]:
        head += 1
    tail = 0
    while tail < min(len(real), len(fake)) - head and real[-1 - tail] == fake[-1 - tail]:
        tail += 1
    text, stand_in_text = real[head:len(real) - tail], fake[head:len(fake) - tail]
    mark = stand_in[0]["function"]["name"].rsplit("_", 1)[0]
    usable = mark in stand_in_text and fake.count(stand_in_text) == 1
    return ToolsBlock(usable=usable, stand_in=stand_in, stand_in_text=stand_in_text, text=text)


def render_with(block: ToolsBlock, messages: list[dict[str, Any]], tools: list[dict[str, Any]], render: Render
                ) -> Any:
    """The template's text for ``messages`` with the stand-in tools and the real block put back; the
    plain render where the stand-in block is not found exactly once, and for the first render of a
    block (compared with it: a difference retires the block)."""
    text = render(messages, block.stand_in)
    if not isinstance(text, str) or text.count(block.stand_in_text) != 1:
        return render(messages, tools)
    text = text.replace(block.stand_in_text, block.text)
    if not block.checked:
        plain = render(messages, tools)
        block.checked, block.usable = True, plain == text
        return plain
    return text
