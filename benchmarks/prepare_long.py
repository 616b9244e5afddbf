"""``prepare`` of one long conversation with a row budget, before and after the history floor (issue 44, item 15).

Why this exists: a conversation of 8,000 short messages with a row budget took 266 s to prepare (2,000: 68 s;
wall seconds on the loaded 2-core machine). Rendering was already linear in the conversation once its views
were *proven* over the budget (``onepass.render.preskip``, issue 37), but the proof used a floor of the
messages' contents alone: on short messages the template's own text (role headers, added tokens) is most of
a view, the floor a third of it, and every view from the budget to three times the budget was rendered and
tokenized only to be skipped, a quadratic stretch (2,000 short messages: 500,500 messages handed to the
template). The history floor counts the template's text before the last user message exactly, from the last
turn's prompt rendered and encoded once, so the views rendered are those that fit and a few more.

Measured side by side on the same machine: **before** is the code of an older commit (``--before``, default
b757769, the issue's main), extracted with ``git archive`` into a temporary folder; **after** is this tree.
Each measurement is a fresh process (``--worker``) that builds the conversation, loads the tokenizer
(``builtin:qwen3``, the real Qwen3 vocabulary and template), warms it up, then times ``prepare`` of the one
conversation (``PrepareConfig(schedule="budget", max_tokens=...)``, as ``onepass prepare --schedule budget
--max-tokens N`` runs it): process CPU seconds (one tokenizer thread), template calls and the messages handed to
the template, and a SHA-256 of the rows and of the counts and skip reasons, so "the same rows" is checked, not
assumed. Before and after alternate, ``--repeats`` times each; the table has the fastest of each.

Beside them, **the tokenizer's own cost** (in the after process): encoding the conversation's text once (the
last turn's prompt, every message as the template renders it) and encoding the text of the views prepare keeps
(prompt and completion of each, the N-pass text that is trained), each with the tokenizer's own batch call.

Two conversations: ``short`` (``q17`` / ``a17``: 9 tokens a message with Qwen3's markup, the issue's case) and
``qa`` (render_scaling.py's questions and answers with reasoning, ~17 tokens a message).

    .venv/bin/python benchmarks/prepare_long.py                 # ~15 min of CPU, most of it the before runs
    .venv/bin/python benchmarks/prepare_long.py --sizes 500,2000 --repeats 1     # a quick look

Writes ``results.json`` and ``results.md`` to ``--out`` (default benchmarks/results/prepare-long).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
DATE = "2026-11-29"


def conversation(kind: str, messages: int) -> dict:
    """``messages`` alternating user and assistant messages (an assistant last)."""
    out = []
    for i in range(messages // 2):
        if kind == "short":
            out += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
        else:
            out += [{"role": "user", "content": f"Question {i}: what is {i} plus {i + 1}?"},
                    {"role": "assistant", "content": f"It is {2 * i + 1}.", "reasoning_content": f"Add {i} and {i + 1}."}]
    return {"messages": out}


def worker(kind: str, messages: int, max_tokens: int, own_cost: bool) -> dict:
    """One measurement in this process (whichever ``onepass`` is first on the path)."""
    import onepass.render.template as template
    from onepass.conversation.parse import parse_record
    from onepass.layout.tree import COLUMNS
    from onepass.layout.view import View
    from onepass.prepare.pipeline import PrepareConfig, prepare
    from onepass.render import render_conversation, render_texts
    from onepass.render.token_floor import pair_table
    from onepass.render.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin:qwen3")
    conv = parse_record(conversation(kind, messages), source=f"{kind}{messages}.jsonl")
    config = PrepareConfig(schedule="budget", max_tokens=max_tokens, template_date=DATE)
    prepare([parse_record(conversation(kind, 4))], tok, config)  # the template's probes, outside the count
    pair_table(tok)  # once per tokenizer, before the first view over the budget (render_scaling.py reports it)
    calls = [0, 0]
    real = template.apply_template

    def counting(tokenizer, msgs, **kw):
        calls[0] += 1
        calls[1] += len(msgs)
        return real(tokenizer, msgs, **kw)

    template.apply_template = counting
    t0 = time.process_time()
    rows, stats = prepare([conv], tok, config)
    seconds = time.process_time() - t0
    template.apply_template = real
    h = hashlib.sha256()
    for row in rows:
        for column in COLUMNS:
            h.update(getattr(row, column).tobytes())
    counts = {k: v for k, v in stats.to_dict().items() if k not in ("skipped",)}
    out = {"seconds": seconds, "template_calls": calls[0], "messages_to_template": calls[1],
           "views_trained": stats.views_trained, "views_skipped": stats.views_skipped, "rows": len(rows),
           "rows_sha256": h.hexdigest(), "counts_sha256": hashlib.sha256(json.dumps(counts, sort_keys=True).encode())
           .hexdigest()}
    if own_cost:  # the tokenizer's own cost: the conversation's text once, and the text of the views kept
        rendered = render_conversation(conv, tok, config.render, max_tokens=max_tokens)
        kept = {v.turn for v in rendered.views if isinstance(v, View) and len(v) <= max_tokens}
        texts = [t for turn, p, c in render_texts(_only(conv, kept), tok, config.render) for t in (p, c)]
        from onepass.render import render_prompt

        whole = render_prompt(conv, tok, len(conv.messages) - 1, config.render.kwargs())
        t0 = time.process_time()
        tok([whole], add_special_tokens=False)
        out["tokenize_conversation_seconds"] = time.process_time() - t0
        t0 = time.process_time()
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        out["tokenize_kept_views_seconds"] = time.process_time() - t0
        out["kept_view_tokens"] = sum(map(len, ids))
        out["conversation_tokens"] = len(tok(whole, add_special_tokens=False)["input_ids"])
    return out


def _only(conv, turns):
    """``conv`` with every assistant turn but ``turns`` marked not to train (OpenAI weight 0): their views alone."""
    import dataclasses

    return dataclasses.replace(conv, messages=tuple(
        dataclasses.replace(m, train=m.train and k in turns) if m.role == "assistant" else m
        for k, m in enumerate(conv.messages)))


def run_worker(src: Path, kind: str, messages: int, max_tokens: int, own_cost: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, __file__, "--worker", kind, str(messages), str(max_tokens)] + ["--own-cost"] * own_cost
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"worker {src} {kind} {messages} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def old_tree(rev: str) -> Path:
    """``rev``'s ``src/`` extracted with git archive into a temporary folder (this checkout is not touched)."""
    folder = Path(tempfile.mkdtemp(prefix="onepass-before-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder / "src"


def environment() -> dict:
    import tokenizers
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"device": f"CPU ({cpu}), {os.cpu_count()} cores, one tokenizer thread", "python": platform.python_version(),
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "template": "Qwen3 (builtin:qwen3)"}


def markdown(r: dict) -> str:
    env = r["environment"]
    lines = [f"Device: {env['device']}; Python {env['python']}, transformers {env['transformers']}, tokenizers "
             f"{env['tokenizers']}; {env['template']}; before = {r['before']}, after = this tree; "
             f"`prepare --schedule budget --max-tokens {r['max_tokens']}` of one conversation; process CPU seconds, "
             f"the fastest of {r['repeats']} (before and after alternating); load average at the start "
             f"{env['load_average']}.", "",
             "| conversation | messages | before: CPU s | messages to the template | after: CPU s | messages to the "
             "template | speed-up | same rows and counts | views kept / skipped | tokenizer alone: the "
             "conversation once / the views kept, CPU s | after / tokenizing the views kept |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["series"]:
        b, a = x.get("before"), x["after"]
        before = f"{b['seconds']:.2f} | {b['messages_to_template']:,}" if b else "(not run) | "
        same = (b["rows_sha256"] == a["rows_sha256"] and b["counts_sha256"] == a["counts_sha256"]) if b else ""
        speed = f"{b['seconds'] / a['seconds']:.1f}x" if b else ""
        lines.append(f"| {x['kind']} | {x['messages']:,} | {before} | {a['seconds']:.2f} | "
                     f"{a['messages_to_template']:,} | {speed} | {same} | {a['views_trained']} / {a['views_skipped']} | "
                     f"{a['tokenize_conversation_seconds']:.3f} / {a['tokenize_kept_views_seconds']:.3f} | "
                     f"{a['seconds'] / max(a['tokenize_kept_views_seconds'], 1e-9):.1f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", nargs=3, metavar=("KIND", "MESSAGES", "MAX_TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--own-cost", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="500,1000,2000,4000,8000", help="messages of the conversation")
    parser.add_argument("--kinds", default="short,qa")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--before", default="b757769", help="the commit measured as before ('' to skip)")
    parser.add_argument("--before-up-to", type=int, default=4000, help="run before only up to this many messages "
                        "(8,000 short messages took 266 s of wall time)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/prepare-long")
    args = parser.parse_args(argv)
    if args.worker:
        kind, messages, max_tokens = args.worker
        print(json.dumps(worker(kind, int(messages), int(max_tokens), args.own_cost)))
        return 0
    before = old_tree(args.before) if args.before else None
    after = ROOT / "src"
    results = {"environment": environment(), "before": args.before or None, "max_tokens": args.max_tokens,
               "repeats": args.repeats, "series": []}
    ok = True
    for kind in args.kinds.split(","):
        for n in map(int, args.sizes.split(",")):
            runs: dict[str, list[dict]] = {"before": [], "after": []}
            for r in range(args.repeats):
                if before is not None and n <= args.before_up_to:
                    runs["before"].append(run_worker(before, kind, n, args.max_tokens, False))
                runs["after"].append(run_worker(after, kind, n, args.max_tokens, r == 0))
            row = {"kind": kind, "messages": n}
            for side, got in runs.items():
                if got:
                    best = min(got, key=lambda x: x["seconds"])
                    row[side] = {**got[0], **best, "all_seconds": [x["seconds"] for x in got]}
            if "before" in row:
                row["same"] = (row["before"]["rows_sha256"] == row["after"]["rows_sha256"]
                               and row["before"]["counts_sha256"] == row["after"]["counts_sha256"])
                ok &= row["same"]
            results["series"].append(row)
            b = row.get("before")
            print(f"{kind} {n:5d} messages: after {row['after']['seconds']:6.2f} s CPU "
                  f"({row['after']['messages_to_template']:,} messages to the template)"
                  + (f", before {b['seconds']:6.2f} s ({b['messages_to_template']:,}), same rows and counts: "
                     f"{row['same']}" if b else "")
                  + f"; tokenizer alone: {row['after']['tokenize_kept_views_seconds']:.3f} s for the views kept",
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results) + "\n")
    print(markdown(results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
