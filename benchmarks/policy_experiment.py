"""What the training policy does to a model: one rendering vs each turn in its own view (issue 46, item 2).

Why this exists: whether training a multi-turn reasoning conversation as one rendering teaches a model
something other than what it does at inference is argued both ways (fw-ai/cookbook #386: fine-tuned
models "still emit an empty <think></think> on ~50% of responses"; torchtitan #2769: "negligible
impact", unverified) and measured by nobody. This runs the measurement, small enough for a CPU:

Task (seeded, synthetic): multi-turn addition. Turn 1 asks ``a+b`` (two-digit numbers), each later turn
``+c``: add ``c`` to the previous answer, which only the history holds. Each turn's reasoning is the
column-by-column sum (``5+7+0=12`` per column, carries written out), its answer ``The answer is N.``,
so the answer needs that turn's reasoning, and every turn after the first needs an earlier turn's
result. Depth 1 to 4 turns, uniform.

Template: onepass's ``builtin:chatml_reasoning`` (the Qwen3 rule: an assistant turn's reasoning is rendered
only after the last user message, so every earlier turn's is dropped), the model's template at
inference. A small Qwen3-architecture model (``onepass.model.tiny``), trained from scratch on a character
vocabulary, with four policies on the same conversations, in the same order, for the same optimizer
steps at the same learning rate:

    a  single rendering: the whole conversation through the template, every assistant turn a target
       (TRL-style SFT with assistant-only loss: benchmarks/policy/drop_marked.jinja is the template with
       {% generation %} markers, the same text); earlier turns are trained without their reasoning
    b  single rendering with a keep-all template (benchmarks/policy/keep_marked.jinja; what TRL's
       SFTTrainer swaps in for Qwen3 with assistant_only_loss): every turn with its reasoning, each
       conditioned on earlier reasoning the inference prompt never holds
    c  onepass: each turn in its own view (its inference prompt, then the turn), one tree per conversation
    d  onepass --train-turns last: the last turn of each conversation only (the maintainers' advice)

Every model is evaluated as it is used: turn by turn with the real template (``onepass.evaluate``: the
prompt of turn k is the template's rendering of ``messages[:k]``; history: the data set's answers, and
again with the model's own), greedy, on held-out conversations; per turn: the rate of replies without
reasoning, the answer accuracy, and the loss on the held-out views (each turn's inference prompt and
completion, per completion token). Seeds 0, 1, 2 (model init, training data and order); every seed run
is reported, none dropped. The token budget of each policy (tokens through the model and trained target
tokens per step) is recorded beside its results.

    .venv/bin/python benchmarks/policy_experiment.py   # ~930 CPU s: ~8 min on 2 idle cores (--jobs 2)
    .venv/bin/python benchmarks/policy_experiment.py --smoke --out /tmp/p  # seconds (tests/bench)

Writes results/policy/{policy.json, policy.md, policy.png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).parent
DROP_MARKED = (HERE / "policy" / "drop_marked.jinja").read_text(encoding="utf-8")
KEEP_MARKED = (HERE / "policy" / "keep_marked.jinja").read_text(encoding="utf-8")
POLICIES = {
    "a": "single rendering, reasoning-dropping template (every turn a target)",
    "b": "single rendering, keep-all template (every turn a target)",
    "c": "onepass (each turn in its own view)",
    "d": "onepass, last turn only (--train-turns last)",
}
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
CHARS = "0123456789+=.:\n Tabcdefghijklmnopqrstuvwxyz"
ROW = 1024  # tokens of a packed row (documents in a row see nothing of each other: onepass's mask)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The experiment's size: what ``--smoke`` shrinks."""

    train_conversations: int = 3000
    eval_conversations: int = 200
    steps: int = 300
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 20
    hidden: int = 96
    layers: int = 2
    heads: int = 4
    max_depth: int = 4
    max_new_tokens: int = 80
    seeds: tuple[int, ...] = (0, 1, 2)
    histories: tuple[str, ...] = ("reference", "model")


SMOKE = Settings(train_conversations=16, eval_conversations=4, steps=2, batch=4, warmup=1, hidden=32, layers=1,
                 heads=2, max_depth=2, max_new_tokens=6, seeds=(0,), histories=("reference",))


# ------------------------------------------------------------------ the task


def _column_sum(p: int, q: int) -> tuple[str, int]:
    """The reasoning of ``p + q``: one line per column, right to left, carries written out; and the sum."""
    a, b = str(p)[::-1], str(q)[::-1]
    lines, carry, digits = [f"{p}+{q}"], 0, []
    for i in range(max(len(a), len(b))):
        x, y = int(a[i]) if i < len(a) else 0, int(b[i]) if i < len(b) else 0
        s = x + y + carry
        lines.append(f"{x}+{y}+{carry}={s}")
        digits.append(s % 10)
        carry = s // 10
    total = int(("1" if carry else "") + "".join(map(str, digits[::-1])))
    assert total == p + q
    return "\n".join(lines + [f"={total}"]), total


def task_record(rng: np.random.Generator, max_depth: int) -> dict[str, Any]:
    """One conversation: turn 1 ``a+b``, then ``+c`` on the previous answer, ``1..max_depth`` turns."""
    depth = int(rng.integers(1, max_depth + 1))
    messages: list[dict[str, Any]] = []
    x = None
    for t in range(depth):
        c = int(rng.integers(10, 100))
        if x is None:
            x = int(rng.integers(10, 100))
            question, (reasoning, total) = f"{x}+{c}", _column_sum(x, c)
        else:
            question, (reasoning, total) = f"+{c}", _column_sum(x, c)
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": f"The answer is {total}.", "reasoning_content": reasoning}]
        x = total
    return {"messages": messages}


def conversations(n: int, seed: int, max_depth: int) -> list[Any]:
    from onepass.conversation.parse import parse_record

    rng = np.random.default_rng(seed)
    return [parse_record(task_record(rng, max_depth), source=f"addition seed {seed}", index=i) for i in range(n)]


def make_tokenizer() -> Any:
    """A character vocabulary (every character one token, the chat markers one each), with onepass's
    reasoning-dropping template: the model's tokenizer at inference."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from onepass.render.tokenizer import builtin_template

    vocab = {t: i for i, t in enumerate([*SPECIAL, "<unk>", *CHARS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = builtin_template("chatml_reasoning")
    return tok


# ------------------------------------------------------------------ the policies' rows


def policy_rows(policy: str, convs: Sequence[Any], tok: Any) -> list[Any]:
    """One row per conversation: TRL's tokenization with assistant masks for the single renderings (a, b),
    onepass's one-pass tree for the views (c, d)."""
    from onepass.prepare.config import DataConfig
    from onepass.prepare.pipeline import PrepareStats, prepare_conversation
    from onepass.render.messages import template_messages
    from onepass.train.core.sft_rows import MESSAGES, SftSettings, causal_layout, tokenize_record

    if policy in ("a", "b"):
        settings = SftSettings(assistant_only_loss=True, chat_template=DROP_MARKED if policy == "a" else KEEP_MARKED)
        return [causal_layout(tokenize_record({"messages": template_messages(c)}, MESSAGES, tok, settings))
                for c in convs]
    config = DataConfig(schedule="one-pass", train_turns="last" if policy == "d" else "all", template_date="2026-01-01")
    stats = PrepareStats().configure(config)
    rows = []
    for c in convs:
        (tree,) = prepare_conversation(c, tok, config, stats, strict=True)
        rows.append(tree)
    return rows


def check_templates(convs: Sequence[Any], tok: Any) -> None:
    """drop_marked.jinja renders what the model's template renders (only the markers differ)."""
    from onepass.render.messages import template_messages

    for c in convs:
        messages = template_messages(c)
        own = tok.apply_chat_template(messages, tokenize=False)
        marked = tok.apply_chat_template(messages, tokenize=False, chat_template=DROP_MARKED)
        assert own == marked, "drop_marked.jinja no longer renders as chatml_reasoning"


def budget(rows: Sequence[Any]) -> dict[str, int]:
    return {"tokens": int(sum(len(r) for r in rows)), "targets": int(sum(r.num_targets for r in rows))}


# ------------------------------------------------------------------ training and evaluation


def train(rows: Sequence[Any], vocab: int, settings: Settings, seed: int, order: np.ndarray) -> tuple[Any, list]:
    """``settings.steps`` AdamW steps on batches of ``settings.batch`` rows in ``order``; the loss of a step is
    the mean over its trained target tokens (token weighting)."""
    import torch

    from onepass.attention.backends import default_backend
    from onepass.layout.pack import pack_layouts
    from onepass.loss import batch_loss, layouts_to_batch
    from onepass.model.tiny import tiny_model

    model = tiny_model("qwen3", vocab, seed=seed, attn_implementation=default_backend("cpu"),
                       hidden_size=settings.hidden, intermediate_size=4 * settings.hidden,
                       num_hidden_layers=settings.layers, num_attention_heads=settings.heads,
                       num_key_value_heads=settings.heads, head_dim=settings.hidden // settings.heads,
                       max_position_embeddings=2048).train()
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.98), weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < settings.warmup:
            return (step + 1) / settings.warmup
        progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    losses = []
    for step in range(settings.steps):
        idx = order[step * settings.batch:(step + 1) * settings.batch]
        step_rows = [rows[i] for i in idx]  # packed into rows of ROW tokens: less padding, the same loss
        batch = layouts_to_batch(pack_layouts(step_rows, max(ROW, *map(len, step_rows))))
        loss = batch_loss(model, batch) / batch["weights"].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return model.eval(), losses


def heldout_loss(model: Any, views_by_turn: dict[int, list[Any]]) -> dict[int, float]:
    """Per turn: the loss of the held-out views (inference prompt, then the turn), per completion token."""
    import torch

    from onepass.layout.tree import build_layout
    from onepass.loss import layouts_to_batch, row_losses

    out = {}
    with torch.no_grad():
        for turn, views in sorted(views_by_turn.items()):
            total = 0.0
            for i in range(0, len(views), 64):
                chunk = views[i:i + 64]
                total += float(row_losses(model, layouts_to_batch([build_layout([v]) for v in chunk])).sum())
            out[turn] = total / sum(v.num_completion for v in views)
    return out


def evaluate_turns(model: Any, tok: Any, heldout: Sequence[Any], settings: Settings, history: str) -> dict[int, dict]:
    """Per turn: replies, replies without reasoning, answers scored, correct, no final answer: generated turn by
    turn with the real template and counted by ``onepass eval``'s own code (``onepass.evaluate``)."""
    from onepass.evaluate.generate import HFGenerator
    from onepass.evaluate.report import summarize
    from onepass.evaluate.run import evaluate, template_prompt

    generator = HFGenerator(model, tok, max_new_tokens=settings.max_new_tokens, batch_size=64)
    summary = summarize(evaluate(heldout, generator, template_prompt(tok), history=history))
    return {c["turn"]: {"replies": c["turns"], "no_reasoning": c["no_reasoning"], "scored": c["scored"],
                        "correct": c["correct"], "no_answer": c["no_answer"]} for c in summary["per_turn"]}


def one_run(settings: Settings, seed: int, policy: str, threads: int) -> dict[str, Any]:
    """Train ``policy`` on seed ``seed``'s conversations and evaluate it: one cell of the experiment."""
    import torch

    from onepass.render import render_conversation

    torch.set_num_threads(threads)
    tok = make_tokenizer()
    heldout = conversations(settings.eval_conversations, 10_000, settings.max_depth)
    views_by_turn: dict[int, list[Any]] = {}
    for c in heldout:
        for t, v in enumerate(render_conversation(c, tok).views, 1):
            views_by_turn.setdefault(t, []).append(v)
    train_convs = conversations(settings.train_conversations, seed, settings.max_depth)
    check_templates(train_convs[:50], tok)
    rng = np.random.default_rng(seed)
    need = settings.steps * settings.batch
    order = np.concatenate([rng.permutation(len(train_convs)) for _ in range(need // len(train_convs) + 1)])[:need]
    t0, c0 = time.perf_counter(), time.process_time()
    rows = policy_rows(policy, train_convs, tok)
    model, losses = train(rows, len(tok), settings, seed, order)
    used = budget([rows[i] for i in order])
    t1, c1 = time.perf_counter(), time.process_time()
    evals = {h: evaluate_turns(model, tok, heldout, settings, h) for h in settings.histories}
    out = {"seed": seed, "policy": policy, "train_loss_last10": float(np.mean(losses[-10:])),
           "tokens_per_step": used["tokens"] / settings.steps, "targets_per_step": used["targets"] / settings.steps,
           "heldout_loss": heldout_loss(model, views_by_turn), "eval": evals,
           "train_seconds": t1 - t0, "train_cpu_seconds": c1 - c0, "eval_seconds": time.perf_counter() - t1,
           "eval_cpu_seconds": time.process_time() - c1}
    print(summary_line(out), flush=True)
    return out


def _cell_path(cells: Path, seed: int, policy: str) -> Path:
    return cells / f"seed{seed}-{policy}.json"


def _int_keys(run: dict[str, Any]) -> dict[str, Any]:
    """A run read back from JSON: its turns are numbers again, as :func:`one_run` returns them."""
    return {**run, "heldout_loss": {int(t): v for t, v in run["heldout_loss"].items()},
            "eval": {h: {int(t): v for t, v in ev.items()} for h, ev in run["eval"].items()}}


def _one_run(cell: tuple[Settings, int, str, int, Path]) -> dict[str, Any]:
    settings, seed, policy, threads, cells = cell
    out = one_run(settings, seed, policy, threads)
    path = _cell_path(cells, seed, policy)  # each cell on disk as it ends: a run stopped early keeps what it ran
    path.write_text(json.dumps({"settings": dataclasses.asdict(settings), "run": out}, indent=1) + "\n",
                    encoding="utf-8")
    return out


def finished(settings: Settings, cells: Path, seed: int, policy: str) -> dict[str, Any] | None:
    """The cell's run from an earlier invocation with the same settings, or None."""
    path = _cell_path(cells, seed, policy)
    if not path.exists():
        return None
    saved = json.loads(path.read_text(encoding="utf-8"))
    same = saved["settings"] == json.loads(json.dumps(dataclasses.asdict(settings)))
    return _int_keys(saved["run"]) if same else None


def run(settings: Settings, threads: int, policies: Sequence[str] = tuple(POLICIES), jobs: int = 1,
        cells: Path | None = None, collect: bool = False) -> dict[str, Any]:
    """Every (seed, policy) cell, on ``jobs`` forked processes of ``threads`` torch threads each, seed by seed;
    each cell is written to ``cells`` as it ends, and a cell already there with the same settings is not run
    again (a stopped run resumes). ``collect``: run nothing, report the cells there (``missing`` lists the rest).
    The runs come back in (seed, policy) order whichever finishes first."""
    import tempfile

    cells = cells or Path(tempfile.mkdtemp(prefix="policy-cells-"))
    cells.mkdir(parents=True, exist_ok=True)
    keys = [(seed, policy) for seed in settings.seeds for policy in policies]
    done = {k: r for k in keys if (r := finished(settings, cells, *k)) is not None}
    todo = [(settings, seed, policy, threads, cells) for seed, policy in keys if (seed, policy) not in done]
    if todo and not collect:
        if jobs > 1:
            import multiprocessing

            with multiprocessing.get_context("fork").Pool(jobs) as pool:
                for r in pool.imap_unordered(_one_run, todo, chunksize=1):
                    done[(r["seed"], r["policy"])] = r
        else:
            for cell in todo:
                r = _one_run(cell)
                done[(r["seed"], r["policy"])] = r
    report: dict[str, Any] = {"settings": dataclasses.asdict(settings), "policies": POLICIES,
                              "runs": [done[k] for k in keys if k in done],
                              "missing": [f"seed {s} policy {p}" for s, p in keys if (s, p) not in done]}
    report["table"] = table(report)
    return report


# ------------------------------------------------------------------ the report


def _rate(d: dict, key: str, of: str) -> float | None:
    return d[key] / d[of] if d.get(of) else None


def summary_line(r: dict) -> str:
    ev = r["eval"]["reference"]
    turns = sorted(ev, key=int)
    no_r = " ".join(f"{_rate(ev[t], 'no_reasoning', 'replies'):.2f}" for t in turns)
    acc = " ".join(f"{_rate(ev[t], 'correct', 'scored'):.2f}" for t in turns)
    return (f"seed {r['seed']} policy {r['policy']}: train loss {r['train_loss_last10']:.3f}; per turn no-reasoning "
            f"{no_r}; accuracy {acc}; ({r['tokens_per_step']:.0f} tokens, {r['targets_per_step']:.0f} targets a step; "
            f"{r['train_seconds']:.0f} s train, {r['eval_seconds']:.0f} s eval)")


def _stats(values: list[float]) -> dict[str, float]:
    x = np.asarray(values, dtype=float)
    return {"mean": float(x.mean()), "min": float(x.min()), "max": float(x.max())}


def table(report: dict) -> dict[str, Any]:
    """Per policy, history and turn: the mean (and min, max over seeds) of each metric."""
    out: dict[str, Any] = {}
    for policy in POLICIES:
        runs = [r for r in report["runs"] if r["policy"] == policy]
        if not runs:
            continue
        p: dict[str, Any] = {"tokens_per_step": _stats([r["tokens_per_step"] for r in runs]),
                             "targets_per_step": _stats([r["targets_per_step"] for r in runs]), "turns": {}}
        for turn in sorted({int(t) for r in runs for t in r["heldout_loss"]}):
            row: dict[str, Any] = {"heldout_loss": _stats([r["heldout_loss"][turn] for r in runs])}
            for h in report["settings"]["histories"]:
                evs = [r["eval"][h][turn] for r in runs if turn in r["eval"][h]]
                row[f"no_reasoning_{h}"] = _stats([e["no_reasoning"] / e["replies"] for e in evs])
                row[f"accuracy_{h}"] = _stats([e["correct"] / e["scored"] for e in evs if e["scored"]])
            p["turns"][turn] = row
        out[policy] = p
    return out


def markdown(report: dict, env: dict) -> str:
    s = report["settings"]
    wall = "collected from cells on disk" if env.get("wall_seconds") is None else f"{env['wall_seconds']:.0f} s wall"
    lines = [f"# Training policy experiment ({len(s['seeds'])} seeds: {', '.join(map(str, s['seeds']))})", "",
             f"{env['device']}; torch {env['torch']}, transformers {env['transformers']}; {env['jobs']} runs at once, "
             f"{env['threads']} thread(s) each; {env['cpu_seconds']:.0f} CPU seconds, all cells, training and "
             f"evaluation (the cost; wall time on a shared machine is not: {wall}). "
             f"Model: Qwen3 architecture, {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, from scratch, "
             f"character vocabulary. {s['steps']} AdamW steps of {s['batch']} conversations, lr {s['lr']} "
             f"(warmup {s['warmup']}, cosine to 10%), {s['train_conversations']} training conversations per seed, "
             f"{s['eval_conversations']} held out. Cells: mean over seeds [min, max].", "",
             *([f"**Not run** (the run was stopped): {', '.join(report['missing'])}.", ""]
               if report.get("missing") else []),
             "| policy | tokens / step | trained targets / step |", "|---|---:|---:|"]
    for policy, p in report["table"].items():
        lines.append(f"| {policy}: {POLICIES[policy]} | {p['tokens_per_step']['mean']:.0f} | "
                     f"{p['targets_per_step']['mean']:.0f} |")

    def cell(st: dict) -> str:
        return f"{st['mean']:.3f} [{st['min']:.3f}, {st['max']:.3f}]"

    for h in s["histories"]:
        lines += ["", f"## History: {h}", "",
                  "| policy | turn | replies without reasoning | accuracy | held-out loss / token |",
                  "|---|---:|---:|---:|---:|"]
        for policy, p in report["table"].items():
            for turn, row in p["turns"].items():
                acc = cell(row[f"accuracy_{h}"]) if row[f"accuracy_{h}"] else "-"
                lines.append(f"| {policy} | {turn} | {cell(row[f'no_reasoning_{h}'])} | {acc} | "
                             f"{cell(row['heldout_loss'])} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("no_reasoning_reference", "replies without reasoning"), ("accuracy_reference", "answer accuracy"),
              ("heldout_loss", "held-out loss / token")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=120)
    for ax, (key, title) in zip(axes, panels):
        for policy, p in report["table"].items():
            turns = [t for t in p["turns"] if p["turns"][t].get(key)]
            mean = [p["turns"][t][key]["mean"] for t in turns]
            lo = [p["turns"][t][key]["mean"] - p["turns"][t][key]["min"] for t in turns]
            hi = [p["turns"][t][key]["max"] - p["turns"][t][key]["mean"] for t in turns]
            ax.errorbar(turns, mean, yerr=[lo, hi], marker="o", capsize=3, label=f"{policy}: {POLICIES[policy]}")
        ax.set_title(title)
        ax.set_xlabel("assistant turn")
        ax.set_xticks(sorted({t for p in report["table"].values() for t in p["turns"]}))
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle("training policy, evaluated turn by turn with the reasoning-dropping template "
                 "(mean over seeds, bars: min-max)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def environment(threads: int, jobs: int) -> dict[str, Any]:
    import torch
    import transformers

    return {"device": f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores visible)",
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "threads": threads, "jobs": jobs}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "results" / "policy"))
    parser.add_argument("--smoke", action="store_true", help="a tiny run (seconds): the test suite's")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, each a forked process (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each run (default 1)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the settings')")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds (default 0 1 2)")
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), help="a subset (default: all four)")
    parser.add_argument("--collect", action="store_true",
                        help="run nothing: report the cells OUT/cells holds (a run stopped early; the rest listed)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = SMOKE if args.smoke else Settings()
    if args.steps:
        settings = dataclasses.replace(settings, steps=args.steps)
    if args.seeds:
        settings = dataclasses.replace(settings, seeds=tuple(args.seeds))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args.threads, args.jobs)
    print(json.dumps(env), flush=True)
    t0 = time.perf_counter()
    report = run(settings, args.threads, policies=args.policies or list(POLICIES), jobs=args.jobs,
                 cells=out / "cells", collect=args.collect)
    report["environment"] = {**env, "wall_seconds": None if args.collect else time.perf_counter() - t0,
                             "cpu_seconds": sum(r["train_cpu_seconds"] + r["eval_cpu_seconds"] for r in report["runs"])}
    if not report["runs"]:
        print(f"no finished cells in {out / 'cells'}", file=sys.stderr)
        return 1
    (out / "policy.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (out / "policy.md").write_text(markdown(report, report["environment"]), encoding="utf-8")
    plot(report, out / "policy.png")
    print(f"wrote {out / 'policy.json'}, policy.md, policy.png ({report['environment']['cpu_seconds']:.0f} CPU s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
