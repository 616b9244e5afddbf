"""The command line as a user meets it: outputs on disk, one-line errors, nothing lost silently."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from onepass.cli import main
from onepass.conversation.parse import read_conversations
from onepass.data.sources import load_conversations
from onepass.data.mathchat import sample_path
from onepass.prepare.pipeline import PrepareConfig, load_rows, prepare
from onepass.layout.tree import COLUMNS

GOOD = {"messages": [{"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "4", "reasoning_content": "add"},
                     {"role": "user", "content": "and 3+3?"},
                     {"role": "assistant", "content": "6", "reasoning_content": ""}]}
BAD_ROLE = {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}


def write_jsonl(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_prepare_writes_exactly_the_columns_and_stats(tmp_path, qwen3_tokenizer):
    out = tmp_path / "prepared"
    assert main(["prepare", "--data", "builtin:mathchat", "--limit", "12", "--out", str(out),
                 "--no-progress"]) == 0
    import datasets

    ds = datasets.load_from_disk(str(out))
    assert ds.column_names == list(COLUMNS)
    stats = json.loads((out / "stats.json").read_text())
    assert stats["conversations"] == 12 and stats["rows"] == stats["trees"] == len(ds) == 12
    assert stats["n_pass_tokens"] > stats["one_pass_tokens"] == stats["row_tokens"]
    assert stats["token_ratio"] == pytest.approx(stats["n_pass_tokens"] / stats["one_pass_tokens"])
    assert stats["skipped"] == []
    # what is on disk is what prepare computed in memory
    convs = read_conversations(sample_path(), limit=12).conversations
    rows, _ = prepare(convs, qwen3_tokenizer, PrepareConfig())
    for a, b in zip(rows, load_rows(out)):
        for c in COLUMNS:
            np.testing.assert_array_equal(getattr(a, c), getattr(b, c))


def test_turn_weights_survive_the_disk_exactly(tmp_path, qwen3_tokenizer):
    """1/n weights are not representable in float32: the disk keeps them in float64, bit for bit."""
    out = tmp_path / "turn"
    assert main(["prepare", "--data", "builtin:mathchat", "--limit", "6", "--out", str(out),
                 "--weighting", "turn", "--no-progress"]) == 0
    convs = read_conversations(sample_path(), limit=6).conversations
    rows, _ = prepare(convs, qwen3_tokenizer, PrepareConfig(weighting="turn"))
    stored = load_rows(out)
    assert any((r.weights.astype(np.float32) != r.weights).any() for r in rows)  # the case float32 would lose
    for a, b in zip(rows, stored, strict=True):
        np.testing.assert_array_equal(a.weights, b.weights)


def test_prepare_packed_rows_fit_the_budget(tmp_path):
    out = tmp_path / "packed"
    assert main(["prepare", "--data", "builtin:mathchat", "--limit", "20", "--out", str(out),
                 "--max-tokens", "2048", "--pack", "--schedule", "budget", "--no-progress"]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rows"] < stats["trees"]
    assert all(len(r) <= 2048 for r in load_rows(out))
    assert stats["padding_tokens"] == stats["rows"] * 2048 - stats["row_tokens"]


def test_prepare_counts_every_skip(tmp_path, capsys):
    data = write_jsonl(tmp_path / "mixed.jsonl", [GOOD, BAD_ROLE, "{not json", GOOD])
    out = tmp_path / "out"
    assert main(["prepare", "--data", str(data), "--out", str(out), "--max-tokens", "30",
                 "--schedule", "n-pass", "--no-progress"]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["conversations"] == 2
    assert stats["skipped_by_reason"]["invalid record"] == 2
    assert any("line 2, message 1: unknown role 'bot'" in s for s in stats["skipped"])
    assert any("line 3: not valid JSON" in s for s in stats["skipped"])
    # the second view of each conversation is longer than 30 tokens: counted, not dropped silently
    assert stats["skipped_by_reason"]["over max_tokens"] == stats["views_skipped"] == 2
    assert "SKIPPED 4" in capsys.readouterr().out


def test_strict_stops_at_the_first_bad_record_with_one_line(tmp_path, capsys):
    data = write_jsonl(tmp_path / "bad.jsonl", [GOOD, BAD_ROLE])
    assert main(["prepare", "--data", str(data), "--out", str(tmp_path / "o"), "--strict"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"onepass: error: {data} line 2, message 1: unknown role 'bot'; "
                   "expected one of system, developer, user, assistant, tool"]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv,message", [
    (["prepare", "--data", "missing.jsonl", "--out", "o"], "data file not found: missing.jsonl"),
    (["prepare", "--data", "builtin:mathchat", "--out", "o", "--pack"], "pack needs a row budget"),
    (["verify", "--data", "builtin:mathchat", "--model", "no/such-model"], "is not a local path"),
    (["prepare", "--data", "builtin:mathchat", "--out", "o", "--chat-template", "nope.jinja"],
     "chat template file not found: nope.jinja"),
    (["prepare", "--data", "builtin:mathchat", "--out", "o", "--template-kwarg", "oops"], "KEY=VALUE"),
])
def test_user_errors_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("onepass: error: ") and message in err[0]


def test_unknown_schedule_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        main(["prepare", "--data", "x", "--out", "o", "--schedule", "two-pass"])
    assert e.value.code == 2 and "unknown schedule 'two-pass'" in capsys.readouterr().err


def test_template_that_cannot_split_names_the_turn(tmp_path, capsys):
    template = tmp_path / "r1.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}|{% endfor %}"
                        "{% if add_generation_prompt %}<think>\n{% endif %}")
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    argv = ["prepare", "--data", str(data), "--out", str(tmp_path / "o"), "--chat-template", str(template)]
    assert main(argv) == 1  # lenient: counted, then nothing left to write
    assert "nothing to write" in capsys.readouterr().err
    assert main(argv + ["--strict"]) == 2
    assert f"{data} line 1, message 1: the chat template's rendering" in capsys.readouterr().err
    assert main(argv + ["--completion-format", "deepseek-r1"]) == 0


def test_verify_prints_json_last(capsys):
    assert main(["verify", "--data", "builtin:mathchat", "--limit", "2", "--tiny", "llama"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("loss_n_pass", "loss_one_pass", "max_abs_loss_diff", "max_rel_grad_diff"):
        assert key in last
    assert last["equal"] and last["rel_loss_diff"] <= 1e-9 and last["num_views"] == 6


def test_verify_names_its_device_and_refuses_a_backend_the_device_cannot_run(capsys, monkeypatch):
    """``--device cuda`` (make gpu-check's verify step) and ``--attn flex_attention`` (CUDA only): on CPU each
    is one line before any model is built, and the JSON names the device both sides ran on."""
    assert main(["verify", "--data", "builtin:mathchat", "--limit", "1", "--attn", "sdpa", "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["device"] == "cpu"
    assert main(["verify", "--data", "builtin:mathchat", "--limit", "1", "--attn", "flex_attention"]) == 2
    assert capsys.readouterr().err.strip() == ("onepass: error: flex_attention has no backward pass on CPU; use "
                                               "onepass_cpu, sdpa or eager on CPU")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["verify", "--data", "builtin:mathchat", "--limit", "1", "--device", "cuda"]) == 2
    assert capsys.readouterr().err.strip() == "onepass: error: --device cuda: torch sees no CUDA device here"


def test_show_writes_a_png(tmp_path):
    out = tmp_path / "mask.png"
    assert main(["show", "--data", "builtin:mathchat", "--index", "3", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_index_out_of_range(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    assert main(["show", "--data", str(data), "--index", "5", "--out", str(tmp_path / "m.png")]) == 2
    assert "--index 5 is out of range: 1 valid conversations" in capsys.readouterr().err


def test_data_convert_mathchat(tmp_path, capsys):
    src = tmp_path / "follow_up.jsonl"
    write_jsonl(src, [{"question": "Q?", "answer": "2+2=<<2+2=4>>4\n#### 4",
                       "followup": "A: Q2?\nB: 4+1=5. The answer is \\ANSWER{5}."}])
    out = tmp_path / "conv.jsonl"
    assert main(["data", "convert-mathchat", "--input", str(src), "--out", str(out)]) == 0
    (record,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "user", "assistant"]
    assert main(["prepare", "--data", str(out), "--out", str(tmp_path / "p"), "--no-progress"]) == 0


def test_key_value_flags_parse_the_same_in_every_subcommand():
    import argparse

    from onepass.key_value import parse_key_value, template_kwargs
    from onepass.train.cli import add_parser

    assert parse_key_value("enable_thinking=false") == ("enable_thinking", False)
    assert parse_key_value("n=3") == ("n", 3) and parse_key_value("a=b=c") == ("a", "b=c")
    assert parse_key_value("name=qwen 3") == ("name", "qwen 3") and parse_key_value("e=") == ("e", "")
    with pytest.raises(ValueError, match="--template-kwarg expects KEY=VALUE, got '=1'"):
        parse_key_value("=1")
    pairs = ["enable_thinking=true", "depth=2", "tag=x"]
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    train_args = parser.parse_args(["train", *[x for p in pairs for x in ("--template-kwarg", p)]])
    assert dict(train_args.template_kwargs) == template_kwargs(pairs) == {"enable_thinking": True, "depth": 2,
                                                                           "tag": "x"}


# ---------------------------------------------------------------------------------------------
# one --data resolver: every spec through every command


@pytest.fixture
def shared_tokenizer(monkeypatch, qwen3_tokenizer):
    """builtin:qwen3 loaded once for the whole matrix (a load takes ~1.5 s; the result is the same)."""
    import onepass.bench.command  # noqa: F401  (every command's code loaded, so each binding is replaced)
    import onepass.evaluate.command  # noqa: F401
    import onepass.render.tokenizer
    import onepass.train.run.loop  # noqa: F401
    import onepass.verify.check  # noqa: F401

    real = onepass.render.tokenizer.load_tokenizer

    def load(spec, *, chat_template=None):
        if spec == "builtin:qwen3" and chat_template is None:
            return qwen3_tokenizer
        return real(spec, chat_template=chat_template)

    for module in [m for n, m in sys.modules.items() if n.startswith("onepass")]:  # every module that imported it
        if getattr(module, "load_tokenizer", None) is real:
            monkeypatch.setattr(module, "load_tokenizer", load)


@pytest.fixture(scope="module")
def prepared_rows(tmp_path_factory):
    from data_specs import write_prepared

    return write_prepared(tmp_path_factory.mktemp("rows"))


def _spec(kind, tmp_path, prepared_rows):
    from data_specs import write_spec

    return prepared_rows if kind == "rows" else write_spec(kind, tmp_path / "data")


def _train_argv(spec, out):
    return ["train", "--tiny", "qwen3", "--data", spec, "--max-steps", "1", "--limit", "2", "--output-dir", str(out),
            "--no-progress", "--no-save-model", "--report-to", "none", "--device", "cpu"]


NEEDS_CONVERSATIONS = "prepared rows (written by onepass prepare), not conversations; this command needs conversations"
COMMANDS = ("prepare", "verify", "show", "train", "bench")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "folder", "saved", "builtin", "synthetic", "rows"])
def test_every_data_spec_through_every_command(kind, command, tmp_path, capsys, shared_tokenizer, prepared_rows,
                                               one_thread):
    """Whatever ``prepare`` accepts, every command accepts; prepared rows are for train only (one line elsewhere)."""
    spec = _spec(kind, tmp_path, prepared_rows)
    out = tmp_path / "out"
    if kind == "rows" and command != "train":
        argv = {"prepare": ["prepare", "--data", spec, "--out", str(out)],
                "verify": ["verify", "--data", spec],
                "show": ["show", "--data", spec, "--out", str(out / "m.png")],
                "bench": ["bench", "--data", spec, "--out", str(out)]}[command]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("onepass: error: ") and NEEDS_CONVERSATIONS in err[0], err
        assert not out.exists()
        return
    expected = load_conversations(spec, limit=2).conversations if kind != "rows" else None
    if command == "prepare":
        assert main(["prepare", "--data", spec, "--out", str(out), "--limit", "2", "--no-progress"]) == 0
        assert json.loads((out / "stats.json").read_text())["conversations"] == 2
    elif command == "verify":
        assert main(["verify", "--data", spec, "--limit", "2", "--tiny", "qwen3"]) == 0
        last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert last["equal"] and last["num_conversations"] == 2
        assert last["num_views"] == sum(c.num_assistant_turns for c in expected)
    elif command == "show":
        assert main(["show", "--data", spec, "--limit", "2", "--index", "1", "--out", str(out / "m.png")]) == 0
        assert (out / "m.png").read_bytes()[:4] == b"\x89PNG"
    elif command == "train":
        assert main(_train_argv(spec, out)) == 0
        metrics = json.loads((out / "metrics.json").read_text())
        assert (metrics["unit"], metrics["units"]) == (("row", 2) if kind == "rows" else ("conversation", 2))
    else:  # a whole bench run times every setting in fresh processes (tests/bench); its data is this
        from onepass.bench.cli import load_workload

        assert load_workload(spec, 2) == expected


@pytest.mark.parametrize("command", [*COMMANDS, "data stats"])
@pytest.mark.parametrize("make,message", [
    (lambda d: "missing.jsonl", "data file not found: missing.jsonl"),
    (lambda d: "builtin:nope", "unknown built-in data 'builtin:nope'"),
    (lambda d: "synthetic:nope", "unknown synthetic workload 'nope'"),
    (lambda d: (d / "empty").mkdir() or "empty", "folder empty has no data files"),
    (lambda d: (d / "notes.txt").write_text("x") and "notes.txt", "notes.txt: unsupported file type '.txt'"),
], ids=["missing", "builtin", "synthetic", "empty-folder", "txt"])
def test_a_bad_data_spec_is_one_line_and_exit_2_for_every_command(command, make, message, tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = make(tmp_path)
    argv = {"prepare": ["prepare", "--data", spec, "--out", "o"],
            "verify": ["verify", "--data", spec],
            "show": ["show", "--data", spec, "--out", "m.png"],
            "train": _train_argv(spec, "t"),
            "bench": ["bench", "--data", spec, "--out", "b"],
            "data stats": ["data", "stats", "--data", spec, "--tokenizer", "none"]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("onepass: error: ") and message in err[0], err
    assert not any((tmp_path / name).exists() for name in ("o", "m.png", "t", "b"))


def test_a_bug_inside_a_command_is_not_swallowed(monkeypatch, capsys, shared_tokenizer):
    """Only OnePassError is a user error: a ValueError from deep inside (numpy, torch, us) keeps its traceback."""
    import onepass.prepare.show

    def broken(*args, **kwargs):
        raise ValueError("operands could not be broadcast together")

    monkeypatch.setattr(onepass.prepare.show, "show", broken)
    with pytest.raises(ValueError, match="could not be broadcast"):
        main(["show", "--data", "builtin:mathchat", "--limit", "1", "--out", "m.png"])
    assert "onepass: error" not in capsys.readouterr().err


def test_onepass_debug_shows_the_traceback_of_a_user_error(monkeypatch):
    from onepass.errors import DataNotFound

    monkeypatch.setenv("ONEPASS_DEBUG", "1")
    with pytest.raises(DataNotFound, match="missing.jsonl"):
        main(["prepare", "--data", "missing.jsonl", "--out", "o"])


def test_subcommands_are_plain_imports_and_nothing_imports_the_cli():
    """cli.py imports its commands' parser modules (no importlib strings); only the entry points import cli."""
    import ast
    from pathlib import Path

    import onepass.cli

    src = Path(onepass.cli.__file__).parent
    cli_imports = {n.module for n in ast.walk(ast.parse(Path(onepass.cli.__file__).read_text()))
                   if isinstance(n, ast.ImportFrom)} | {a.name for n in ast.walk(ast.parse(
                       Path(onepass.cli.__file__).read_text())) if isinstance(n, ast.Import) for a in n.names}
    assert "importlib" not in cli_imports
    assert {"onepass.train", "onepass.prepare", "onepass.bench"} <= cli_imports  # from onepass.X import cli as X_cli
    importers = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if "onepass.cli" in names:
                importers.append(path.relative_to(src).as_posix())
    assert sorted(set(importers)) == ["__main__.py", "demo.py"]


def test_cli_is_a_registry_of_parsers_that_live_beside_their_code():
    """cli.py adds no argument and runs no command itself: every command comes from a module of COMMANDS,
    and every runner a command names as "module:function" exists."""
    import argparse

    import onepass.cli
    from onepass.lazy import resolve

    source = Path(onepass.cli.__file__).read_text()
    assert "add_argument(\"--data" not in source and "def cmd_" not in source
    parser = onepass.cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    names = set(sub.choices)
    assert names == {"prepare", "verify", "show", "train", "data", "bench", "export", "eval", "templates"}
    todo = list(sub.choices.items())
    while todo:  # a command's own subcommands (templates check) set the runner on their parsers
        name, command = todo.pop()
        nested = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        func = command.get_default("func")
        if func is None and nested:
            todo += [(f"{name} {n}", c) for n, c in nested[0].choices.items()]
            continue
        assert func is not None, name
        assert callable(func if not isinstance(func, str) else resolve(func)), (name, func)


HELP_COMMANDS = [[], ["prepare"], ["verify"], ["show"], ["train"], ["train", "--help-all"], ["data"],
                 ["data", "stats"], ["data", "augment"], ["bench"], ["export"], ["eval"], ["templates", "check"]]


def test_help_of_every_command_imports_no_torch():
    """``onepass --help`` and every ``onepass CMD --help`` answer without importing torch (or transformers):
    the registry imports parsers only, each command's runner is imported when it runs. One subprocess
    (a fresh interpreter, nothing imported yet) parses every --help in turn."""
    code = ("import sys\nfrom onepass.cli import build_parser\nbad = []\n"
            f"for argv in {HELP_COMMANDS!r}:\n"
            "    try:\n        build_parser().parse_args([*argv, '--help'] if argv[-1:] != ['--help-all'] else argv)\n"
            "    except SystemExit:\n        pass\n"
            "    bad += [(argv, m) for m in ('torch', 'transformers', 'datasets') if m in sys.modules]\n"
            "print(bad, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.strip() == "[]", out.stderr
    assert out.stdout.count("usage: onepass") >= len(HELP_COMMANDS)  # every --help printed its parser
