"""Render cost against the length of one conversation: per turn, per conversation, template calls (issue 37).

Why this exists: a conversation of 2,000 messages took 96 s to render and 8,000 did not finish in 300 s.
Every view's prompt is the chat template's own rendering of ``messages[:k]`` with the generation prompt
(that is what makes a view exact for any template), so turn k hands k messages to the template and gets
a text of length ~k back: a conversation of n turns renders ~n^2/2 messages, the N-pass text. This
measures how the cost splits, with the real Qwen3 template and vocabulary, on one core:

- **one turn at position k** (k = 250 ... 8,000 messages): the only trained turn of a conversation whose
  other assistant turns have OpenAI ``weight`` 0 (context, no view): the cost of one view, two template
  calls of k messages and the tokenizing of its text. Linear in k is the most rendering can do.
- **a whole conversation of n messages** (n = 125 ... 1,000 by default): every turn a view; CPU seconds,
  template calls (per turn: a constant), messages handed to the template (the sum of k), N-pass and
  one-pass tokens; and the same with ``--max-tokens`` (the views over it are not tokenized).
- **a template that raises** for every turn past a length (naming the length, so every prefix raises
  another text): template calls of the whole conversation, where naming the message it raises for used
  to render every prefix again for every turn.

Writes ``results.json``, ``results.md`` and ``render_scaling.png`` to ``--out``.

    .venv/bin/python benchmarks/render_scaling.py                       # ~10 min CPU on one core
    .venv/bin/python benchmarks/render_scaling.py --turn-positions 250,8000 --conversations 125,250
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

RAISING = ("{% if messages|length > 6 %}{{ raise_exception('too long: ' ~ (messages|length)) }}{% endif %}"
           "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def record(messages: int, *, only_last: bool = False) -> dict:
    """``messages`` alternating user / assistant messages (an assistant last), each answer with reasoning;
    ``only_last``: every assistant turn but the last has OpenAI weight 0 (context only, no view)."""
    out = []
    for i in range(messages // 2):
        out.append({"role": "user", "content": f"Question {i}: what is {i} plus {i + 1}?"})
        answer = {"role": "assistant", "content": f"It is {2 * i + 1}.", "reasoning_content": f"Add {i} and {i + 1}."}
        if only_last and i < messages // 2 - 1:
            answer["weight"] = 0
        out.append(answer)
    return {"messages": out}


class Counter:
    """Template calls and the messages handed to the template, counted at onepass.render.template.apply_template."""

    def __init__(self) -> None:
        import onepass.render.template as template

        self.calls = self.messages = 0
        self._module, self._real = template, template.apply_template

        def counting(tokenizer, messages, **kw):
            self.calls += 1
            self.messages += len(messages)
            return self._real(tokenizer, messages, **kw)

        template.apply_template = counting

    def reset(self) -> None:
        self.calls = self.messages = 0


def cpu(fn):
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turn-positions", default="250,500,1000,2000,4000,8000",
                        help="messages before the one trained turn (comma-separated)")
    parser.add_argument("--conversations", default="125,250,500,1000", help="messages of a whole conversation")
    parser.add_argument("--raising", default="100,200,400", help="messages of a conversation the template raises for")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--out", default="benchmarks/results/render-scaling")
    args = parser.parse_args(argv)

    import numpy as np
    import tokenizers
    import transformers

    from onepass.conversation.parse import parse_record
    from onepass.render import render_conversation
    from onepass.render.tokenizer import load_tokenizer
    from onepass.layout.tree import count_nodes
    from onepass.layout.view import View

    tok = load_tokenizer("builtin:qwen3")
    counter = Counter()
    render_conversation(parse_record(record(2)), tok)  # the template's fields are probed once, outside the counts
    env = {"device": f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores (one used; load "
                     f"{os.getloadavg()[0]:.1f} at start)",
           "python": sys.version.split()[0], "transformers": transformers.__version__,
           "tokenizers": tokenizers.__version__, "template": "Qwen3 (builtin:qwen3)"}
    print(env)

    turns = []
    for k in map(int, args.turn_positions.split(",")):
        conv = parse_record(record(k + 2, only_last=True))
        counter.reset()
        rendered, seconds = cpu(lambda: render_conversation(conv, tok))
        (view,) = rendered.views
        turns.append({"position": k + 1, "seconds": seconds, "template_calls": counter.calls,
                      "messages_to_template": counter.messages, "view_tokens": len(view)})
        print(f"turn at message {k + 1:5d}: {seconds:7.3f} s CPU, {counter.calls} template calls of "
              f"{counter.messages} messages, view {len(view):,} tokens")

    whole = []
    for n in map(int, args.conversations.split(",")):
        conv = parse_record(record(n))
        counter.reset()
        rendered, seconds = cpu(lambda: render_conversation(conv, tok))
        calls, handed = counter.calls, counter.messages
        views = [v for v in rendered.views if isinstance(v, View)]
        counter.reset()
        budget, seconds_budget = cpu(lambda: render_conversation(conv, tok, max_tokens=args.max_tokens))
        whole.append({"messages": n, "turns": n // 2, "seconds": seconds, "template_calls": calls,
                      "calls_per_turn": calls / (n // 2), "messages_to_template": handed,
                      "n_pass_tokens": sum(len(v) for v in views), "one_pass_tokens": count_nodes(views),
                      "seconds_max_tokens": seconds_budget,
                      "over_max_tokens": sum(not isinstance(v, View) or len(v) > args.max_tokens
                                             for v in budget.views),
                      "not_tokenized": sum(not isinstance(v, View) for v in budget.views)})
        print(f"conversation of {n:5d} messages: {seconds:7.2f} s CPU, {calls} template calls "
              f"({calls / (n // 2):.1f} per turn) of {handed:,} messages; N-pass {whole[-1]['n_pass_tokens']:,} "
              f"tokens, one-pass {whole[-1]['one_pass_tokens']:,}; --max-tokens {args.max_tokens}: "
              f"{seconds_budget:.2f} s ({whole[-1]['over_max_tokens']} views over it, skipped by prepare; "
              f"{whole[-1]['not_tokenized']} of them not tokenized: their token floor is over it)")

    raising = []
    before = tok.chat_template
    tok.chat_template = RAISING
    try:
        render_conversation(parse_record(record(2)), tok)
        for n in map(int, args.raising.split(",")):
            conv = parse_record(record(n))
            counter.reset()
            rendered, seconds = cpu(lambda: render_conversation(conv, tok))
            raising.append({"messages": n, "turns": n // 2, "skipped": len(rendered.skipped), "seconds": seconds,
                            "template_calls": counter.calls, "calls_per_turn": counter.calls / (n // 2)})
            print(f"raising template, {n} messages: {counter.calls} template calls ({counter.calls / (n // 2):.1f} "
                  f"per turn), {seconds:.2f} s")
    finally:
        tok.chat_template = before

    def exponent(xs, ys):  # the slope of log y against log x: 1 linear, 2 quadratic
        return float(np.polyfit(np.log(xs), np.log(ys), 1)[0]) if len(xs) > 1 else float("nan")

    fit = {"one_turn_seconds_vs_position": exponent([t["position"] for t in turns], [t["seconds"] for t in turns]),
           "conversation_seconds_vs_messages": exponent([w["messages"] for w in whole], [w["seconds"] for w in whole]),
           "conversation_calls_vs_messages": exponent([w["messages"] for w in whole],
                                                      [w["template_calls"] for w in whole]),
           "raising_calls_vs_messages": exponent([r["messages"] for r in raising],
                                                 [r["template_calls"] for r in raising])}
    per_message = [w["seconds"] / w["messages_to_template"] for w in whole]
    results = {"environment": env, "max_tokens": args.max_tokens, "one_turn": turns, "conversation": whole,
               "raising_template": raising, "fitted_exponents": fit,
               "seconds_per_message_handed_to_the_template": per_message}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results) + "\n")
    plot(results, out / "render_scaling.png")
    print(json.dumps(fit))
    return 0


def markdown(r: dict) -> str:
    env = r["environment"]
    lines = [f"Device: {env['device']}; Python {env['python']}, transformers {env['transformers']}, tokenizers "
             f"{env['tokenizers']}; {env['template']}.", "",
             "One trained turn at message k (the others weight 0):", "",
             "| position k | CPU s | template calls | messages to the template | view tokens |", "|---|---|---|---|---|"]
    lines += [f"| {t['position']:,} | {t['seconds']:.3f} | {t['template_calls']} | {t['messages_to_template']:,} | "
              f"{t['view_tokens']:,} |" for t in r["one_turn"]]
    lines += ["", f"A whole conversation (every turn a view; then with --max-tokens {r['max_tokens']}):", "",
              "| messages | CPU s | template calls | per turn | messages to the template | N-pass tokens | "
              "one-pass tokens | CPU s with max_tokens | views over it | of them not tokenized |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {w['messages']:,} | {w['seconds']:.2f} | {w['template_calls']:,} | {w['calls_per_turn']:.1f} | "
              f"{w['messages_to_template']:,} | {w['n_pass_tokens']:,} | {w['one_pass_tokens']:,} | "
              f"{w['seconds_max_tokens']:.2f} | {w['over_max_tokens']} | {w['not_tokenized']} |" for w in r["conversation"]]
    lines += ["", "A template that raises for every turn past 6 messages, naming the length:", "",
              "| messages | template calls | per turn | CPU s |", "|---|---|---|---|"]
    lines += [f"| {x['messages']} | {x['template_calls']:,} | {x['calls_per_turn']:.1f} | {x['seconds']:.2f} |"
              for x in r["raising_template"]]
    fit = r["fitted_exponents"]
    lines += ["", "Fitted exponents (slope of log cost against log size; 1 = linear, 2 = quadratic): "
              + ", ".join(f"{k} {v:.2f}" for k, v in fit.items())]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    t = r["one_turn"]
    axes[0].plot([x["position"] for x in t], [x["seconds"] for x in t], "o-")
    axes[0].set(title="one view at message k", xlabel="k (messages before it)", ylabel="CPU s")
    w = r["conversation"]
    axes[1].plot([x["messages"] for x in w], [x["seconds"] for x in w], "o-", label="every view")
    axes[1].plot([x["messages"] for x in w], [x["seconds_max_tokens"] for x in w], "s--",
                 label=f"--max-tokens {r['max_tokens']}")
    axes[1].set(title="a whole conversation", xlabel="messages", ylabel="CPU s")
    axes[1].legend()
    x = r["raising_template"]
    axes[2].plot([y["messages"] for y in w], [y["calls_per_turn"] for y in w], "o-", label="Qwen3")
    axes[2].plot([y["messages"] for y in x], [y["calls_per_turn"] for y in x], "s-", label="raising template")
    axes[2].set(title="template calls per turn", xlabel="messages", ylabel="calls / turn", ylim=(0, None))
    axes[2].legend()
    fig.suptitle(f"render cost, {r['environment']['template']}, {r['environment']['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
