"""Pictures of a conversation's one-pass attention mask (the seed paper's figure 2).

Why this module exists: the whole method is one mask rule over a depth-first
tree layout (``q sees k <=> k <= q < kv_end[k]``), and it is much easier to
trust once you can see which tokens each query sees. :func:`show` renders a
conversation, builds its tree exactly as training does, gives every tree node
a *role* read from the text offsets, and draws the L x L grid: row = query,
column = key, a visible cell is coloured by the role of its key.

Roles (per tree node)::

    template     chat-template markup in a prompt (<|im_start|>user\\n, <|im_end|>, ...)
    prompt-user  system, user, tool-definition and tool-result text in a prompt
    history      an earlier assistant answer as a later prompt shows it (response-in)
    reasoning    trained tokens up to and including </think>  (<think>\\n\\n</think> of
                 a turn with empty reasoning is reasoning too: it is trained markup)
    response     trained tokens after </think> (the answer and its <|im_end|>)

Worked example (two turns; t = template, u = user text, r = reasoning,
a = response, h = history; one letter stands for a run of tokens). Row q,
column k: ``x`` visible (drawn in k's colour), ``.`` hidden by the tree
(light grey: causal packing would show it), blank: the future::

               t  u  t  r1 a1 h1 t  u  t  r2 a2
    t   0      x
    u   1      x  x
    t   2      x  x  x
    r1  3      x  x  x  x
    a1  4      x  x  x  x  x
    h1  5      x  x  x  .  .  x
    t   6      x  x  x  .  .  x  x
    u   7      x  x  x  .  .  x  x  x
    t   8      x  x  x  .  .  x  x  x  x
    r2  9      x  x  x  .  .  x  x  x  x  x
    a2 10      x  x  x  .  .  x  x  x  x  x  x

Nothing here is needed for training; matplotlib is imported only when drawing. ``onepass show``
(:func:`add_parser`, :func:`run`) draws the ``--index``-th conversation of ``--data``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from onepass.conversation.parse import Conversation, Message
from onepass.data.sources import load_conversations, print_skipped
from onepass.prepare.config import RENDER_KEYS, add_data_arguments, data_config_from_args
from onepass.errors import DataError, UsageError
from onepass.prepare.cli import add_input_arguments
from onepass.render import RenderConfig, render_texts, render_views
from onepass.layout.schedule import Schedule, parse_schedule, schedule_views
from onepass.render.tokenizer import load_tokenizer
from onepass.layout.tree import Layout, PrefixTree, concat

ROLES = ("template", "prompt-user", "history", "reasoning", "response")
COLOURS = {  # Okabe-Ito: distinguishable with the common colour-vision deficiencies
    "template": "#A6A6A6",     # grey
    "prompt-user": "#0072B2",  # blue
    "history": "#CC79A7",      # reddish purple
    "reasoning": "#E69F00",    # orange
    "response": "#009E73",     # bluish green
}
HIDDEN_COLOUR = "#E4E4E4"  # k < q but the tree hides k from q (causal packing would show it)
FUTURE_COLOUR = "#FFFFFF"  # k > q: hidden from every mask
SHORT = {"prompt-user": "prompt", "history": "hist", "reasoning": "think", "response": "answer"}
THINK_END = "</think>"


# ---------------------------------------------------------------- roles from text offsets

def _token_roles(ids: Sequence[int], offsets: Sequence[tuple[int, int]], char_roles: np.ndarray
                 ) -> list[str]:
    """A token takes the most frequent non-template role among its characters, else template."""
    out = []
    for s, e in offsets:
        counts = np.bincount(char_roles[s:e], minlength=len(ROLES))
        counts[0] = 0  # template
        out.append(ROLES[int(counts.argmax())] if counts.any() else "template")
    assert len(out) == len(ids)
    return out


def _prompt_char_roles(conv: Conversation, turn: int, prompt: str, cuts: set[int]) -> np.ndarray:
    """Role index per character of the prompt of assistant message ``turn``.

    Each earlier message's text is looked up in order with ``str.find`` from a
    moving cursor; what is not found stays ``template``. An occurrence that
    starts and ends on token boundaries (``cuts``) is preferred, so a user's
    "a" is not found inside ``<|im_start|>assistant``. An assistant message
    spans from its first found piece (reasoning, content, tool call) to its last.
    Text the template rewrites (escapes, reformatted JSON) is not found and is
    drawn as template: a picture's approximation, never used for training.
    """
    roles = np.zeros(len(prompt), dtype=np.int64)
    cursor = 0

    def find(piece: str) -> tuple[int, int] | None:
        piece = piece.strip()
        first = at = prompt.find(piece, cursor) if piece else -1
        while at >= 0 and not (at in cuts and at + len(piece) in cuts):
            at = prompt.find(piece, at + 1)
        at = first if at < 0 else at
        return None if at < 0 else (at, at + len(piece))

    head = [Message(role="system", content=conv.system)] if conv.system is not None else []
    head += [Message(role="system", content=json.dumps(t, ensure_ascii=False)) for t in conv.tools_at(turn)]
    for message in head + list(conv.messages[:turn]):
        pieces, label = [message.content], "prompt-user"  # system, tool definitions, user, tool
        if message.role == "assistant":
            pieces, label = [message.reasoning or "", message.content], "history"
            for call in message.tool_calls:
                pieces += [call.name, json.dumps(call.arguments, ensure_ascii=False)]
        spans = []
        for piece in pieces:
            span = find(piece)
            if span is not None:
                spans.append(span)
                cursor = span[1]
        if spans:
            roles[spans[0][0]:spans[-1][1]] = ROLES.index(label)
    return roles


def _view_roles(tokenizer: Any, prompt: str, completion: str, conv: Conversation, turn: int
                ) -> tuple[list[int], list[str]]:
    """Token ids and roles of one view, from the offsets of its prompt and completion."""
    enc_p = tokenizer(prompt, return_offsets_mapping=True, add_special_tokens=False)
    enc_c = tokenizer(completion, return_offsets_mapping=True, add_special_tokens=False)
    cuts = {i for span in enc_p["offset_mapping"] for i in span}
    prompt_roles = _token_roles(enc_p["input_ids"], enc_p["offset_mapping"],
                                _prompt_char_roles(conv, turn, prompt, cuts))
    at = completion.find(THINK_END)
    think_end = at + len(THINK_END) if at >= 0 else -1  # no </think>: all response
    completion_roles = ["reasoning" if e <= think_end else "response" for _, e in enc_c["offset_mapping"]]
    return list(enc_p["input_ids"]) + list(enc_c["input_ids"]), prompt_roles + completion_roles


def node_roles(conv: Conversation, tokenizer: Any, config: RenderConfig = RenderConfig(), *,
               schedule: Schedule | str = "one-pass") -> tuple[Layout, list[str]]:
    """The layout of ``conv`` under ``schedule`` (trees concatenated) and the role of each position.

    A node takes its role from the first view that trains it (it is one of that
    view's completion tokens), else from the first view that holds it.
    """
    texts = render_texts(conv, tokenizer, config)
    views = render_views(conv, tokenizer, config)
    per_view = []
    for (turn, prompt, completion), view in zip(texts, views, strict=True):
        ids, roles = _view_roles(tokenizer, prompt, completion, conv, turn)
        assert ids == view.tokens.tolist(), f"offset tokenization differs from the view of turn {turn}"
        per_view.append(roles)

    layouts, all_roles = [], []
    spec = schedule if isinstance(schedule, Schedule) else parse_schedule(schedule)
    for group in schedule_views(views, spec).groups:
        tree = PrefixTree()
        role_of: dict[int, str] = {}
        trained: set[int] = set()
        paths = []
        for i in group:
            path = tree.insert_path(views[i])
            paths.append(path)
            for pos, node in enumerate(path):
                is_trained = pos >= views[i].num_prompt
                if node not in role_of or (is_trained and node not in trained):
                    role_of[node] = per_view[i][pos]
                if is_trained:
                    trained.add(node)
        layout = tree.layout()
        rank = np.empty(len(tree), dtype=np.int64)
        rank[tree.dfs_order()] = np.arange(len(tree))
        assert (layout.input_ids[rank] == np.asarray(tree.tokens)).all()
        for path in paths:  # each view is a root path of the layout: depths 0..n-1
            assert (layout.position_ids[rank[path]] == np.arange(len(path))).all()
        roles = [""] * len(tree)
        for node, role in role_of.items():
            roles[rank[node]] = role
        layouts.append(layout)
        all_roles += roles
    if not layouts:
        raise DataError(f"{conv.source}: no assistant turn to show")
    return concat(layouts), all_roles


# ---------------------------------------------------------------- drawing

def _rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)], dtype=np.float64) / 255


def mask_image(layout: Layout, roles: Sequence[str], n: int | None = None) -> np.ndarray:
    """RGB image [n, n, 3] of the top-left n x n of the mask: visible cells in the key's colour."""
    n = len(layout) if n is None else min(n, len(layout))
    q = np.arange(n)[:, None]
    k = np.arange(n)[None, :]
    visible = (k <= q) & (q < layout.kv_end[:n][None, :])
    key_rgb = np.stack([_rgb(COLOURS[r]) for r in roles[:n]])  # [n, 3]
    img = np.where((k > q)[..., None], _rgb(FUTURE_COLOUR), _rgb(HIDDEN_COLOUR))
    return np.where(visible[..., None], key_rgb[None, :, :], img)


def _runs(roles: Sequence[str]) -> list[tuple[int, int]]:
    """Maximal ``[start, end)`` runs of equal role."""
    cuts = [0] + [p for p in range(1, len(roles)) if roles[p] != roles[p - 1]] + [len(roles)]
    return list(zip(cuts[:-1], cuts[1:]))


def _branch_starts(position_ids: np.ndarray) -> list[int]:
    """Positions where a branch (or a tree) starts: the position id is not the previous one + 1."""
    return [p for p in range(1, len(position_ids)) if position_ids[p] != position_ids[p - 1] + 1]


def draw_mask(layout: Layout, roles: Sequence[str], out_path: str | Path, *, title: str | None = None,
              max_tokens_drawn: int = 400, labels: Sequence[str] | None = None, dpi: int = 150) -> Path:
    """Draw the mask of ``layout`` with ``roles`` (one per position) to a PNG at ``out_path``.

    Layouts longer than ``max_tokens_drawn`` are cut to their top-left square
    (the title says so). ``labels`` (one short string per position) become
    tick labels on both axes.
    """
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state
    from matplotlib.patches import Patch

    if len(roles) != len(layout):
        raise ValueError(f"{len(roles)} roles for a layout of {len(layout)} tokens")
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise ValueError(f"unknown roles {unknown}; use {', '.join(ROLES)}")
    total = len(layout)
    n = min(total, max_tokens_drawn)
    title = title or f"one-pass attention mask, {total} tokens"
    if n < total:
        title += f"\n(top-left {n} x {n} of {total} x {total} shown)"

    # Geometry in inches: [margin | strip | grid | legend] x [title | strip | grid | margin].
    inches = 7.0 if labels is None else max(7.0, 0.13 * n)
    strip_in, legend_in, gap_in = 0.22, 2.3, 0.06
    margin_in = 0.75 if labels is None else 1.0
    top_in = 0.55 + 0.2 * title.count("\n")
    width = margin_in + strip_in + gap_in + inches + gap_in + legend_in
    height = top_in + strip_in + gap_in + inches + margin_in
    fig = Figure(figsize=(width, height))
    grid = fig.add_gridspec(2, 3, width_ratios=[strip_in, inches, legend_in], height_ratios=[strip_in, inches],
                            wspace=gap_in * 3 / width, hspace=gap_in * 2 / height,
                            left=margin_in / width, right=1 - 0.5 * gap_in / width,
                            top=1 - top_in / height, bottom=margin_in / height)
    ax = fig.add_subplot(grid[1, 1])
    top = fig.add_subplot(grid[0, 1], sharex=ax)
    left = fig.add_subplot(grid[1, 0], sharey=ax)
    strip = np.stack([_rgb(COLOURS[r]) for r in roles[:n]])
    top.imshow(strip[None], aspect="auto", interpolation="nearest")
    left.imshow(strip[:, None], aspect="auto", interpolation="nearest")
    ax.imshow(mask_image(layout, roles, n), aspect="auto", interpolation="nearest")

    runs = _runs(roles[:n])
    for s, _ in runs[1:]:  # light lines between role segments
        ax.axvline(s - 0.5, color="white", lw=0.5, alpha=0.8)
        ax.axhline(s - 0.5, color="white", lw=0.5, alpha=0.8)
    for p in _branch_starts(layout.position_ids[:n]):
        ax.axvline(p - 0.5, color="#333333", lw=0.8, ls=":")
        ax.axhline(p - 0.5, color="#333333", lw=0.8, ls=":")
    for s, e in runs:  # name the segments that are wide enough for their name
        if roles[s] in SHORT and (e - s) * inches / n >= 0.07 * len(SHORT[roles[s]]) + 0.05:
            top.text((s + e - 1) / 2, 0, SHORT[roles[s]], ha="center", va="center", fontsize=7,
                     color="white" if roles[s] != "reasoning" else "black")
    top.tick_params(left=False, bottom=False, labelleft=False, labelbottom=False)
    left.tick_params(bottom=False, labelbottom=False)
    ax.tick_params(labelleft=False)
    if labels is not None:
        ticks = list(range(n))
        ax.set_xticks(ticks, [labels[p] for p in ticks], rotation=90, fontsize=6, family="monospace")
        left.set_yticks(ticks, [labels[p] for p in ticks], fontsize=6, family="monospace")
    else:
        ax.set_xlabel("key (layout position)")
        left.set_ylabel("query (layout position)")
    top.set_title(title, fontsize=11)

    legend = [Patch(facecolor=COLOURS[r], label=r) for r in ROLES if r in roles[:n]]
    legend += [Patch(facecolor=HIDDEN_COLOUR, edgecolor="#999999", label="hidden by the tree\n(causal would see)"),
               Patch(facecolor=FUTURE_COLOUR, edgecolor="#999999", label="future (never seen)")]
    side = fig.add_subplot(grid[1, 2])
    side.axis("off")
    side.legend(handles=legend, loc="upper left", frameon=False, fontsize=9,
                title="key role", title_fontsize=10, alignment="left")
    side.text(0.02, 0.02, "row = query, column = key\ndotted line: a branch or a tree\n"
              "starts (tokens that a view does\nnot share with earlier views)",
              transform=side.transAxes, fontsize=8, va="bottom", color="#333333")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=dpi)  # Agg canvas, whatever the session's backend
    return out_path


def token_labels(tokenizer: Any, ids: Sequence[int], width: int = 12) -> list[str]:
    """Short printable form of each token: newlines as \\n, spaces as a middle dot."""
    out = []
    for i in ids:
        text = tokenizer.decode([int(i)]).replace("\n", "\\n").replace(" ", "\u00b7")
        out.append(text if len(text) <= width else text[:width - 1] + "\u2026")
    return out


def show(conv: Conversation, tokenizer: Any, out_path: str | Path, *, config: RenderConfig = RenderConfig(),
         schedule: Schedule | str = "one-pass", tokens_axis: bool = True, max_labelled: int = 60,
         max_tokens_drawn: int = 400, title: str | None = None) -> Path:
    """Draw the mask of ``conv`` under ``schedule`` to ``out_path`` (PNG); returns the path.

    With ``tokens_axis`` and at most ``max_labelled`` tokens, ticks are labelled with the tokens.
    """
    layout, roles = node_roles(conv, tokenizer, config, schedule=schedule)
    if title is None:
        separate = sum(len(v) for v in render_views(conv, tokenizer, config))
        title = (f"{schedule} mask of {conv.num_assistant_turns} views: {len(layout)} tokens "
                 f"({separate} as separate views), {layout.num_targets} trained targets")
    labels = token_labels(tokenizer, layout.input_ids) if tokens_axis and len(layout) <= max_labelled else None
    return draw_mask(layout, roles, out_path, title=title, max_tokens_drawn=max_tokens_drawn, labels=labels)


# ---------------------------------------------------------------------------------------------
# onepass show

SHOW_KEYS = ("schedule", *RENDER_KEYS)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``show`` to ``onepass``'s subcommands."""
    p = subparsers.add_parser("show", help="draw one conversation's tree mask as a PNG")
    add_input_arguments(p)
    p.add_argument("--index", type=int, default=0, help="which valid conversation (0-based)")
    add_data_arguments(p, names=SHOW_KEYS)
    p.add_argument("--out", required=True, help="output .png")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``onepass show``: the ``--index``-th valid conversation's mask to ``--out``."""
    config = data_config_from_args(args, names=SHOW_KEYS)
    limit = None if args.limit is None else max(args.limit, args.index + 1)
    report = load_conversations(args.data, strict=args.strict, limit=limit)  # refuses prepared rows
    print_skipped(report.skipped)
    if not 0 <= args.index < len(report.conversations):
        raise UsageError(f"--index {args.index} is out of range: {len(report.conversations)} valid conversations")
    tokenizer = load_tokenizer(args.tokenizer, chat_template=args.chat_template)
    out = show(report.conversations[args.index], tokenizer, args.out, config=config.render,
               schedule=config.schedule_spec)
    print(f"wrote {out}")
    return 0
