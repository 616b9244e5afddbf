"""What a single rendering would train, per data set and template, against onepass's views (issue 46, item 1).

For every vendored chat template (src/onepass/templates, ../shared/fixtures/chat_templates/reasoning,
tests/fixtures/chat_templates), on the Qwen3 vocabulary (special tokens as text where a model's differ,
as tests/test_real_templates.py uses them), over the bundled MathChat sample and the agent sets
(../shared/data/agent): the turns a single rendering (the whole conversation through the template, every
assistant turn a target: TRL-style SFT) trains without their reasoning, after earlier reasoning the
inference prompt never holds (and without earlier reasoning it holds), and the reasoning tokens it never
trains; the same for onepass's views, whose prompts are checked against the inference prompt
(:mod:`onepass.render.single`, ``check_prompts``). Where the installed TRL has a training template for the
template (``trl.get_training_chat_template``, what ``SFTTrainer`` swaps in under ``assistant_only_loss``),
the single rendering through it is counted too.

    .venv/bin/python benchmarks/single_rendering.py --agent-limit 20    # the recorded run: 434 CPU s, one core
    .venv/bin/python benchmarks/single_rendering.py                    # 50 per agent set: longer
    .venv/bin/python benchmarks/single_rendering.py --agent-limit 20 --templates qwen3 gptoss  # a look

Every figure is computed from the templates' own renderings; nothing is estimated. Writes
results/single_rendering/{single_rendering.json, single_rendering.md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
ROOT = HERE.parent
TEMPLATE_DIRS = (ROOT / "src" / "onepass" / "templates", ROOT.parent / "shared" / "fixtures" / "chat_templates" /
                 "reasoning", ROOT / "tests" / "fixtures" / "chat_templates")
AGENT = ROOT.parent / "shared" / "data" / "agent"
DATASETS = ("builtin:mathchat", "bfcl_base", "bfcl_base_reasoning", "taubench_airline", "taubench_airline_reasoning")
EOS = {"cohere2_tool_use": "<|END_OF_TURN_TOKEN|>"}  # Command R7B's end of turn (as tests/test_real_templates.py)


def templates(names: Sequence[str] | None) -> tuple[dict[str, Path], dict[str, str]]:
    """Every vendored template by name (a second file of the same name: ``FOLDER/NAME``), once per distinct
    text; and the files left out as copies of another (name -> the name measured)."""
    found: dict[str, Path] = {}
    texts: dict[str, str] = {}
    copies: dict[str, str] = {}
    for folder in TEMPLATE_DIRS:
        for path in sorted(folder.glob("*.jinja")):
            key = path.stem if path.stem not in found and path.stem not in copies else f"{folder.name}/{path.stem}"
            text = path.read_text(encoding="utf-8")
            if text in texts:
                copies[f"{folder.name}/{path.stem}"] = texts[text]
                continue
            texts[text], found[key] = key, path
    return {k: v for k, v in found.items() if names is None or k in names}, copies


def data_spec(name: str) -> str:
    return name if name.startswith("builtin:") else str(AGENT / f"{name}.jsonl")


def measure(convs: Sequence[Any], tok: Any, trl_template: str | None) -> dict[str, Any]:
    from onepass.render import RenderConfig, render_conversation
    from onepass.render.single import single_rendering, sum_counts

    config = RenderConfig(template_date="2026-11-29")
    t0 = time.process_time()
    rendered = [render_conversation(c, tok, config, keep_texts=True) for c in convs]
    own = sum_counts(single_rendering(c, tok, config, r, check_prompts=True) for c, r in zip(convs, rendered))
    out: dict[str, Any] = {"own": own.to_dict()}
    if trl_template is not None:
        out["trl"] = sum_counts(single_rendering(c, tok, config, r, template=trl_template)
                                for c, r in zip(convs, rendered)).to_dict()
    out["cpu_seconds"] = round(time.process_time() - t0, 2)
    return out


def trl_template_for(tok: Any) -> str | None:
    from onepass.errors import ConfigError
    from onepass.render.single import trl_training_template

    try:
        template = trl_training_template(tok)
    except ConfigError:
        return None
    return None if template == tok.chat_template else template


def pct(n: int, d: int) -> str:
    return f"{n:,} ({n / d:.0%})" if d else f"{n:,}"


def kind(o: dict[str, int]) -> str:
    """What a template's single rendering does to a data set's reasoning, in one word."""
    if not o["conversations"]:
        return "not rendered"
    if not o["turns_with_reasoning"]:
        return "no reasoning in the data"
    if not o["single_without_reasoning"]:
        return "keeps"
    return "drops all" if o["single_without_reasoning"] >= o["turns_with_reasoning"] else "drops some"


def summary(report: dict[str, Any]) -> list[str]:
    """One line per data set: the templates by what their single rendering does, and Qwen3's figures."""
    lines = ["## Summary", "",
             "Templates by what their single rendering does to the data's reasoning: **keeps** it for every "
             "trained turn, **drops some** (trains some turns without their reasoning: the rule that drops "
             "earlier turns' reasoning), **drops all** (trains every turn with reasoning without it: templates "
             "that render no reasoning of an assistant turn at all; onepass skips those turns, counted), or "
             "renders no conversation whole. Qwen3: without reasoning / after unseen / missing seen / reasoning "
             "tokens never trained, through its own template and through TRL's.", "",
             "| data set | templates | keeps | drops some | drops all | not rendered | no reasoning in the data "
             "| Qwen3 | Qwen3, TRL's template |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for dataset, rows in report["results"].items():
        kinds = [kind(r["own"]) for r in rows.values()]

        def figures(o: dict[str, int] | None) -> str:
            if not o or not o["conversations"]:
                return "-"
            return (f"{pct(o['single_without_reasoning'], o['turns'])} / {o['single_on_unseen_reasoning']:,} / "
                    f"{o['single_missing_seen_reasoning']:,} / "
                    f"{pct(o['single_untrained_reasoning_tokens'], o['reasoning_tokens'])} of {o['turns']:,} turns")

        q = rows.get("qwen3", {})
        counts = " | ".join(str(kinds.count(k)) for k in ("keeps", "drops some", "drops all", "not rendered",
                                                          "no reasoning in the data"))
        lines.append(f"| {dataset} | {len(kinds)} | {counts} | {figures(q.get('own'))} | {figures(q.get('trl'))} |")
    return lines + [""]


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = ["# What a single rendering would train (issue 46, item 1)", "",
             f"onepass {env['onepass_commit']}, transformers {env['transformers']}, trl {env['trl']}; Qwen3 vocabulary "
             "with each template. Per data set and template: of the assistant turns a single rendering trains "
             "(the whole record through the template, every assistant turn a target), how many it trains "
             "**without** their reasoning, **after** earlier reasoning unseen at inference (and **missing** "
             "earlier reasoning seen at inference), and the reasoning tokens it never trains; `TRL`: the same "
             "through TRL's training template (`get_training_chat_template`, what SFTTrainer swaps in with "
             "assistant_only_loss) where TRL has one. onepass: views trained without their reasoning / views whose "
             "prompt differs in reasoning from the inference prompt (checked) / reasoning tokens of trained views "
             "left untrained; turns onepass skips (counted, never trained) are listed apart. `-`: the template "
             "renders no conversation whole."
             + (" Files identical to one measured: " + ", ".join(f"{k} (= {v})" for k, v in
                                                                sorted(report.get("copies", {}).items())) + "."
                if report.get("copies") else ""), ""]
    lines += summary(report)
    for dataset, rows in report["results"].items():
        count = report["conversations"][dataset]
        lines += [f"## {dataset} ({count}{'' if 'conversations' in count else ' conversations'})", "",
                  "| template | turns | without reasoning | after unseen | missing seen | reasoning tokens never trained "
                  "| TRL: without / after unseen / tokens | onepass: without / prompt differs / tokens | onepass skipped "
                  "turns | not renderable whole |",
                  "|---|---:|---:|---:|---:|---:|---|---|---:|---:|"]
        for name, r in rows.items():
            o = r["own"]
            if not o["conversations"]:
                lines.append(f"| {name} | - | - | - | - | - | - | - | {o['onepass_skipped_turns']} | "
                             f"{o['conversations_not_rendered']} |")
                continue
            t = r.get("trl")
            trl = (f"{t['single_without_reasoning']:,} / {t['single_on_unseen_reasoning']:,} / "
                   f"{t['single_untrained_reasoning_tokens']:,}" if t else "")
            differs = o["onepass_on_unseen_reasoning"] + o["onepass_missing_seen_reasoning"]
            lines.append(f"| {name} | {o['turns']:,} | {pct(o['single_without_reasoning'], o['turns'])} | "
                         f"{o['single_on_unseen_reasoning']:,} | {o['single_missing_seen_reasoning']:,} | "
                         f"{pct(o['single_untrained_reasoning_tokens'], o['reasoning_tokens'])} | {trl} | "
                         f"{o['onepass_without_reasoning']:,} / {differs:,} of {o['onepass_prompts_checked']:,} / "
                         f"{o['onepass_untrained_reasoning_tokens']:,} | {o['onepass_skipped_turns']:,} | "
                         f"{o['conversations_not_rendered']:,} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(HERE / "results" / "single_rendering"))
    parser.add_argument("--templates", nargs="+", help="template names (default: every vendored one)")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--agent-limit", type=int, default=50,
                        help="conversations of each agent set per template (default 50; the Qwen3 rows take all)")
    parser.add_argument("--markdown-from", metavar="JSON", help="only write the Markdown of an earlier run's JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.markdown_from:
        report = json.loads(Path(args.markdown_from).read_text(encoding="utf-8"))
        found, copies = templates(None)
        for rows in report["results"].values():  # a run before copies were left out: drop them here
            for name in list(rows):
                if name not in found:
                    rows.pop(name)
        report["copies"] = copies
        Path(args.markdown_from).with_suffix(".md").write_text(markdown(report), encoding="utf-8")
        Path(args.markdown_from).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        return 0
    import subprocess

    import transformers

    from onepass.data.sources import load_conversations
    from onepass.render.tokenizer import load_tokenizer

    try:
        import trl
        trl_version = trl.__version__
    except ImportError:
        trl_version = "not installed"
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    report: dict[str, Any] = {"environment": {"onepass_commit": commit, "transformers": transformers.__version__,
                                              "trl": trl_version, "python": platform.python_version(),
                                              "cpu": platform.processor() or platform.machine()},
                              "agent_limit": args.agent_limit, "conversations": {}, "results": {}}
    tok = load_tokenizer("builtin:qwen3")
    own_template, own_eos = tok.chat_template, tok.eos_token
    found, copies = templates(args.templates)
    report["copies"] = copies
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for dataset in args.datasets:
        full = load_conversations(data_spec(dataset), strict=False).conversations
        report["results"][dataset] = {}
        for name, path in found.items():
            limit = None if dataset.startswith("builtin:") or name == "qwen3" else args.agent_limit
            convs = full[:limit]
            tok.chat_template, tok.eos_token = path.read_text(encoding="utf-8"), EOS.get(name, own_eos)
            try:
                row = measure(convs, tok, trl_template_for(tok))
            finally:
                tok.chat_template, tok.eos_token = own_template, own_eos
            row["conversations"] = len(convs)
            report["results"][dataset][name] = row
            o = row["own"]
            print(f"{dataset} {name} ({len(convs)} conversations): {o['single_without_reasoning']} of {o['turns']} "
                  f"turns without reasoning, {o['single_on_unseen_reasoning']} after unseen, "
                  f"{o['single_missing_seen_reasoning']} missing seen, {o['single_untrained_reasoning_tokens']} of "
                  f"{o['reasoning_tokens']} reasoning tokens never trained; onepass "
                  f"{o['onepass_without_reasoning']}, {o['onepass_on_unseen_reasoning']}, "
                  f"{o['onepass_untrained_reasoning_tokens']}, skipped {o['onepass_skipped_turns']} "
                  f"({row['cpu_seconds']} s)", flush=True)
        report["conversations"][dataset] = (f"{len(full)}" if dataset.startswith("builtin:") else
                                            f"{len(full)} conversations; the first {args.agent_limit} per "
                                            f"template, all {len(full)} for qwen3")
        # written after each data set: a run stopped half way keeps what it measured
        (out / "single_rendering.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        (out / "single_rendering.md").write_text(markdown(report), encoding="utf-8")
    print(f"wrote {out / 'single_rendering.json'} and single_rendering.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
