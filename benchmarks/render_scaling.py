"""Render cost against the length of one conversation: per turn, per conversation, template calls (issue 37).

Why this exists: a conversation of 2,000 messages took 96 s to render and 8,000 did not finish in 300 s.
Every view's prompt is the chat template's own rendering of ``messages[:k]`` with the generation prompt
(that is what makes a view exact for any template), so turn k hands k messages to the template and gets
a text of length ~k back: a conversation of n turns renders ~n^2/2 messages, the N-pass text. Under a
token budget (``--max-tokens``) a view proven over it from the messages it must hold is not rendered at all
(``onepass.render.preskip``). This measures how the cost splits, with the real Qwen3 template and
vocabulary, on one core:

- **one turn at position k** (k = 250 ... 8,000 messages): the only trained turn of a conversation whose
  other assistant turns have OpenAI ``weight`` 0 (context, no view): the cost of one view, two template
  calls of k messages and the tokenizing of its text. Linear in k is the most rendering can do.
- **a whole conversation of n messages with ``--max-tokens``** (n = 250 ... 8,000): CPU seconds, template
  calls, messages handed to the template, views over the budget and how many of them were never rendered;
  beside it, up to ``--reference-up-to`` messages, the same render with the pre-skip off (every view rendered
  to learn its length, as before), and a check that both keep exactly the same views.
- **a real agent conversation with ``--max-tokens``**: tau-bench airline's first record (14 tools, tool calls
  and results) played k times (up to 7,936 messages), the same measures, the pre-skip off up to
  ``--agent-reference-up-to`` messages.
- **a whole conversation of n messages, no budget** (n = 125 ... 2,000 by default): every turn a view;
  CPU seconds, template calls, messages handed to the template, N-pass and one-pass tokens: the N-pass text
  itself, which is quadratic in the turns.
- **a template that raises** for every turn past a length (naming the length, so every prefix raises
  another text): template calls of the whole conversation, where naming the message it raises for used
  to render every prefix again for every turn.

Writes ``results.json``, ``results.md`` and ``render_scaling.png`` to ``--out``.

    .venv/bin/python benchmarks/render_scaling.py                       # ~3 min CPU on one core
    .venv/bin/python benchmarks/render_scaling.py --turn-positions 250,8000 --conversations 125,250 \
        --budgeted 250,8000 --reference-up-to 250
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


AGENT = Path(__file__).resolve().parents[2] / "shared" / "data" / "agent" / "taubench_airline.jsonl"


def agent_record(repeats: int):
    """tau-bench airline's first record (tools, tool calls and results, Qwen3's own agent shape), its messages
    after the system prompt played ``repeats`` times: a long real agent conversation. None without the data."""
    from onepass.conversation.parse import parse_record

    if not AGENT.exists():
        return None
    rec = json.loads(AGENT.read_text(encoding="utf-8").splitlines()[0])
    system = [m for m in rec["messages"] if m["role"] == "system"]
    rest = [m for m in rec["messages"] if m["role"] != "system"]
    return parse_record({**rec, "messages": system + rest * repeats}, source=AGENT.name)


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
    parser.add_argument("--budgeted", default="250,500,1000,2000,4000,8000",
                        help="messages of a whole conversation rendered with --max-tokens")
    parser.add_argument("--reference-up-to", type=int, default=2000,
                        help="render the budgeted conversations up to this many messages with the pre-skip off too")
    parser.add_argument("--conversations", default="125,250,500,1000,2000",
                        help="messages of a whole conversation rendered without a budget")
    parser.add_argument("--raising", default="100,200,400", help="messages of a conversation the template raises for")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--agent-repeats", default="8,32,128,256",
                        help="tau-bench airline's first record (31 messages after its system prompt) played this many "
                             "times, rendered with --agent-max-tokens (skipped when ../shared/data/agent is absent)")
    parser.add_argument("--agent-max-tokens", type=int, default=8192)
    parser.add_argument("--agent-reference-up-to", type=int, default=1000)
    parser.add_argument("--out", default="benchmarks/results/render-scaling")
    args = parser.parse_args(argv)

    import numpy as np
    import tokenizers
    import transformers

    import onepass.render.views as views_module
    from onepass.conversation.parse import parse_record
    from onepass.render import render_conversation
    from onepass.render.token_floor import pair_table
    from onepass.render.tokenizer import load_tokenizer
    from onepass.layout.tree import count_nodes
    from onepass.layout.view import Unmeasured, View

    tok = load_tokenizer("builtin:qwen3")
    counter = Counter()
    render_conversation(parse_record(record(2)), tok)  # the template's fields are probed once, outside the counts
    env = {"device": f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores (one used; load "
                     f"{os.getloadavg()[0]:.1f} at start)",
           "python": sys.version.split()[0], "transformers": transformers.__version__,
           "tokenizers": tokenizers.__version__, "numpy": np.__version__, "template": "Qwen3 (builtin:qwen3)"}
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

    def kept(rendered, max_tokens: int) -> list:  # the views a prepare trains: rendered, within the budget
        return [(v.turn, v.tokens.tobytes()) for v in rendered.views if isinstance(v, View) and len(v) <= max_tokens]

    preskip = views_module._preskip
    _, table_seconds = cpu(lambda: pair_table(tok))  # once per tokenizer, on the first view over the budget
    print(f"the vocabulary's cut table (once per tokenizer): {table_seconds:.2f} s CPU")
    def budgeted_series(convs: dict, max_tokens: int, reference_up_to: int, label: str) -> list[dict]:
        rows = []
        for n, conv in convs.items():
            counter.reset()
            rendered, seconds = cpu(lambda: render_conversation(conv, tok, max_tokens=max_tokens))
            row = {"messages": n, "turns": sum(m.role == "assistant" for m in conv.messages), "seconds": seconds,
                   "template_calls": counter.calls, "messages_to_template": counter.messages,
                   "over_max_tokens": sum(not isinstance(v, View) or len(v) > max_tokens for v in rendered.views),
                   "not_rendered": sum(isinstance(v, Unmeasured) and not v.rendered for v in rendered.views),
                   "kept": len(kept(rendered, max_tokens)), "skipped": len(rendered.skipped)}
            line = (f"{label}, --max-tokens {max_tokens}, {n:5d} messages: {seconds:6.2f} s CPU, {counter.calls} "
                    f"template calls of {counter.messages:,} messages; {row['over_max_tokens']} views over it, "
                    f"{row['not_rendered']} of them not rendered; {row['kept']} kept")
            if n <= reference_up_to:
                views_module._preskip = lambda *a, **kw: None
                counter.reset()
                try:
                    reference, ref_seconds = cpu(lambda: render_conversation(conv, tok, max_tokens=max_tokens))
                finally:
                    views_module._preskip = preskip
                row.update(seconds_without_preskip=ref_seconds, messages_to_template_without_preskip=counter.messages,
                           same_views_kept=kept(reference, max_tokens) == kept(rendered, max_tokens),
                           same_over_count=row["over_max_tokens"] == sum(
                               not isinstance(v, View) or len(v) > max_tokens for v in reference.views),
                           same_skipped=[str(e) for e in reference.skipped] == [str(e) for e in rendered.skipped])
                line += (f" | pre-skip off: {ref_seconds:6.2f} s, {counter.messages:,} messages "
                         f"({ref_seconds / seconds:.1f}x); same views kept: {row['same_views_kept']}")
            rows.append(row)
            print(line)
        return rows

    budgeted = budgeted_series({n: parse_record(record(n)) for n in map(int, args.budgeted.split(","))},
                               args.max_tokens, args.reference_up_to, "chat")
    agent_convs = {}
    for reps in map(int, args.agent_repeats.split(",")):
        conv = agent_record(reps)
        if conv is not None:
            agent_convs[len(conv.messages)] = conv
    agent = budgeted_series(agent_convs, args.agent_max_tokens, args.agent_reference_up_to, "tau-bench")

    whole = []
    for n in map(int, args.conversations.split(",")):
        conv = parse_record(record(n))
        counter.reset()
        rendered, seconds = cpu(lambda: render_conversation(conv, tok))
        views = [v for v in rendered.views if isinstance(v, View)]
        whole.append({"messages": n, "turns": n // 2, "seconds": seconds, "template_calls": counter.calls,
                      "calls_per_turn": counter.calls / (n // 2), "messages_to_template": counter.messages,
                      "n_pass_tokens": sum(len(v) for v in views), "one_pass_tokens": count_nodes(views)})
        print(f"no budget, {n:5d} messages: {seconds:7.2f} s CPU, {counter.calls} template calls "
              f"({counter.calls / (n // 2):.1f} per turn) of {counter.messages:,} messages; N-pass "
              f"{whole[-1]['n_pass_tokens']:,} tokens, one-pass {whole[-1]['one_pass_tokens']:,}")

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

    upper = [b for b in budgeted if b["messages"] >= max(x["messages"] for x in budgeted) / 4]
    reference = [b for b in budgeted if "seconds_without_preskip" in b]
    fit = {"one_turn_seconds_vs_position": exponent([t["position"] for t in turns], [t["seconds"] for t in turns]),
           "budgeted_seconds_vs_messages": exponent([b["messages"] for b in budgeted], [b["seconds"] for b in budgeted]),
           "budgeted_seconds_vs_messages_upper_quarter": exponent([b["messages"] for b in upper],
                                                                  [b["seconds"] for b in upper]),
           "budgeted_messages_to_template_vs_messages": exponent([b["messages"] for b in budgeted],
                                                                 [b["messages_to_template"] for b in budgeted]),
           "budgeted_without_preskip_seconds_vs_messages": exponent(
               [b["messages"] for b in reference], [b["seconds_without_preskip"] for b in reference]),
           "agent_budgeted_seconds_vs_messages": exponent([a["messages"] for a in agent], [a["seconds"] for a in agent]),
           "agent_without_preskip_seconds_vs_messages": exponent(
               [a["messages"] for a in agent if "seconds_without_preskip" in a],
               [a["seconds_without_preskip"] for a in agent if "seconds_without_preskip" in a]),
           "no_budget_seconds_vs_messages": exponent([w["messages"] for w in whole], [w["seconds"] for w in whole]),
           "no_budget_n_pass_tokens_vs_messages": exponent([w["messages"] for w in whole],
                                                           [w["n_pass_tokens"] for w in whole]),
           "no_budget_calls_vs_messages": exponent([w["messages"] for w in whole], [w["template_calls"] for w in whole]),
           "raising_calls_vs_messages": exponent([r["messages"] for r in raising],
                                                 [r["template_calls"] for r in raising])}
    line = np.polyfit([b["messages"] for b in budgeted], [b["seconds"] for b in budgeted], 1)
    results = {"environment": env, "max_tokens": args.max_tokens, "one_turn": turns, "budgeted": budgeted,
               "agent_max_tokens": args.agent_max_tokens, "agent": agent,
               "cut_table_seconds": table_seconds,
               "conversation": whole, "raising_template": raising, "fitted_exponents": fit,
               "budgeted_linear_fit": {"seconds_per_1000_messages": float(line[0]) * 1000,
                                       "seconds_at_0": float(line[1])},
               "seconds_per_message_handed_to_the_template": [w["seconds"] / w["messages_to_template"] for w in whole]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results) + "\n")
    plot(results, out / "render_scaling.png")
    print(json.dumps(fit))
    return 0 if all(b.get("same_views_kept", True) and b.get("same_over_count", True) and b.get("same_skipped", True)
                    for b in [*budgeted, *agent]) else 1


def markdown(r: dict) -> str:
    env = r["environment"]
    lines = [f"Device: {env['device']}; Python {env['python']}, transformers {env['transformers']}, tokenizers "
             f"{env['tokenizers']}, numpy {env['numpy']}; {env['template']}.", "",
             "One trained turn at message k (the others weight 0):", "",
             "| position k | CPU s | template calls | messages to the template | view tokens |", "|---|---|---|---|---|"]
    lines += [f"| {t['position']:,} | {t['seconds']:.3f} | {t['template_calls']} | {t['messages_to_template']:,} | "
              f"{t['view_tokens']:,} |" for t in r["one_turn"]]
    lines += ["", f"A whole conversation with --max-tokens {r['max_tokens']} (every turn a view; a view proven over the "
              "budget is not rendered; then the same with the pre-skip off, every view rendered to learn its length):",
              "", "| messages | CPU s | template calls | messages to the template | views over the budget | "
              "of them not rendered | views kept | pre-skip off: CPU s | messages to the template | same views kept |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for b in r["budgeted"]:
        off = (f"{b['seconds_without_preskip']:.2f} | {b['messages_to_template_without_preskip']:,} | "
               f"{b['same_views_kept'] and b['same_over_count']}" if "seconds_without_preskip" in b else " | | ")
        lines.append(f"| {b['messages']:,} | {b['seconds']:.2f} | {b['template_calls']:,} | "
                     f"{b['messages_to_template']:,} | {b['over_max_tokens']:,} | {b['not_rendered']:,} | {b['kept']} | "
                     f"{off} |")
    lines += ["", f"A real agent conversation (tau-bench airline's first record, tools and tool results, played k "
              f"times) with --max-tokens {r['agent_max_tokens']}, then with the pre-skip off:", "",
              "| messages | CPU s | template calls | messages to the template | views over the budget | "
              "of them not rendered | views kept | pre-skip off: CPU s | messages to the template | same views kept "
              "and skips |", "|---|---|---|---|---|---|---|---|---|---|"]
    for a in r["agent"]:
        off = (f"{a['seconds_without_preskip']:.2f} | {a['messages_to_template_without_preskip']:,} | "
               f"{a['same_views_kept'] and a['same_over_count'] and a['same_skipped']}"
               if "seconds_without_preskip" in a else " | | ")
        lines.append(f"| {a['messages']:,} | {a['seconds']:.2f} | {a['template_calls']:,} | "
                     f"{a['messages_to_template']:,} | {a['over_max_tokens']:,} | {a['not_rendered']:,} | {a['kept']} | "
                     f"{off} |")
    lines += ["", "A whole conversation, no budget (every turn a view, every view rendered):", "",
              "| messages | CPU s | template calls | per turn | messages to the template | N-pass tokens | "
              "one-pass tokens |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {w['messages']:,} | {w['seconds']:.2f} | {w['template_calls']:,} | {w['calls_per_turn']:.1f} | "
              f"{w['messages_to_template']:,} | {w['n_pass_tokens']:,} | {w['one_pass_tokens']:,} |"
              for w in r["conversation"]]
    lines += ["", "A template that raises for every turn past 6 messages, naming the length:", "",
              "| messages | template calls | per turn | CPU s |", "|---|---|---|---|"]
    lines += [f"| {x['messages']} | {x['template_calls']:,} | {x['calls_per_turn']:.1f} | {x['seconds']:.2f} |"
              for x in r["raising_template"]]
    fit, line = r["fitted_exponents"], r["budgeted_linear_fit"]
    lines += ["", f"The vocabulary's cut table (onepass.render.token_floor.pair_table), once per tokenizer, before the "
              f"first view over the budget: {r['cut_table_seconds']:.2f} CPU s (outside the rows above)."]
    lines += ["", "Fitted exponents (slope of log cost against log size; 1 = linear, 2 = quadratic): "
              + ", ".join(f"{k} {v:.2f}" for k, v in fit.items()),
              "", f"Budgeted CPU seconds, least squares line: {line['seconds_at_0']:.2f} s + "
              f"{line['seconds_per_1000_messages']:.3f} s per 1,000 messages."]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    t = r["one_turn"]
    axes[0].plot([x["position"] for x in t], [x["seconds"] for x in t], "o-")
    axes[0].set(title="one view at message k", xlabel="k (messages before it)", ylabel="CPU s")
    b, w = r["budgeted"], r["conversation"]
    ref = [x for x in b if "seconds_without_preskip" in x]
    axes[1].loglog([x["messages"] for x in b], [x["seconds"] for x in b], "o-",
                   label=f"--max-tokens {r['max_tokens']} (pre-skip)")
    axes[1].loglog([x["messages"] for x in ref], [x["seconds_without_preskip"] for x in ref], "s--",
                   label=f"--max-tokens {r['max_tokens']}, pre-skip off")
    axes[1].loglog([x["messages"] for x in w], [x["seconds"] for x in w], "^:", label="no budget (every view)")
    a = r.get("agent", [])
    axes[1].loglog([x["messages"] for x in a], [x["seconds"] for x in a], "D-",
                   label=f"tau-bench x k, --max-tokens {r.get('agent_max_tokens')} (pre-skip)")
    axes[1].loglog([x["messages"] for x in a if "seconds_without_preskip" in x],
                   [x["seconds_without_preskip"] for x in a if "seconds_without_preskip" in x], "x--",
                   label="tau-bench x k, pre-skip off")
    axes[1].set(title="a whole conversation (log-log)", xlabel="messages", ylabel="CPU s")
    axes[1].legend(fontsize=7, loc="upper left")
    axes[2].loglog([x["messages"] for x in b], [x["messages_to_template"] for x in b], "o-", label="pre-skip")
    axes[2].loglog([x["messages"] for x in ref], [x["messages_to_template_without_preskip"] for x in ref], "s--",
                   label="pre-skip off")
    axes[2].loglog([x["messages"] for x in w], [x["messages_to_template"] for x in w], "^:", label="no budget")
    axes[2].loglog([x["messages"] for x in a], [x["messages_to_template"] for x in a], "D-", label="tau-bench x k, pre-skip")
    axes[2].set(title="messages handed to the template", xlabel="messages", ylabel="messages")
    axes[2].legend(fontsize=7, loc="upper left")
    for ax in axes[1:]:  # plain numbers at the decades only (the minor ticks' labels overlap)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:,.0f}"))
        ax.set_xticks(sorted({x["messages"] for x in [*b, *w]}))  # the chat sizes (tau-bench's fall between)
    fig.suptitle(f"render cost, {r['environment']['template']}, {r['environment']['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
