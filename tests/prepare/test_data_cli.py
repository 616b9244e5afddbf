"""``onepass data ...`` as a user meets it: tables printed, files written, one-line errors."""

from __future__ import annotations

import json

from onepass.prepare.data_cli import main
from onepass.data.sources import load_conversations


def test_sample_dry_run_prints_the_papers_allocation(capsys):
    assert main(["sample", "--depth-table", "paper", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "total   144,978    74,535   2,293   8000.00   8,797" in out
    assert "    6   100,443    30,000     200   3219.96   3,219" in out
    assert main(["sample", "--depth-table", "paper", "--dry-run", "--rule", "exact"]) == 0
    assert "8,000\nrule exact" in capsys.readouterr().out


def test_sample_writes_data_report_and_figure(tmp_path, capsys):
    data = tmp_path / "synthetic.jsonl"
    assert main(["synthetic", "--num", "300", "--seed", "1", "--out", str(data)]) == 0
    out = tmp_path / "sampled.jsonl"
    args = ["sample", "--data", str(data), "--out", str(out), "--budget", "60", "--minimum", "5",
            "--cap", "6=40", "--seed", "4", "--report", str(tmp_path / "report.json"),
            "--plot", str(tmp_path / "depths.png")]
    assert main(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["selected"] == report["allocation"]["total"] == len(out.read_text().splitlines())
    assert (tmp_path / "depths.png").stat().st_size > 1000
    first = out.read_bytes()
    assert main(args) == 0 and out.read_bytes() == first  # same seed, same sample
    assert "wrote" in capsys.readouterr().out


def test_stats_json_and_before_after_plot(tmp_path, capsys):
    sampled = tmp_path / "s.jsonl"
    main(["sample", "--data", "builtin:mathchat", "--out", str(sampled), "--budget", "20", "--minimum", "5"])
    out = tmp_path / "stats.json"
    assert main(["stats", "--data", str(sampled), "--tokenizer", "none", "--before", "builtin:mathchat",
                 "--plot", str(tmp_path / "fig.png"), "--out", str(out), "--no-progress"]) == 0
    stats = json.loads(out.read_text())
    assert stats["depths_before"] == {"2": 150, "3": 150}
    assert sum(stats["depths"].values()) == stats["conversations"] == 20
    assert (tmp_path / "fig.png").exists()


def test_synthetic_output_reads_back(tmp_path):
    out = tmp_path / "syn.jsonl"
    assert main(["synthetic", "--num", "5", "--workload", "mathchat-sync-long", "--out", str(out)]) == 0
    assert len(load_conversations(out).conversations) == 5


def test_convert_mathchat_moved_here(tmp_path, capsys):
    line = {"question": "q?", "answer": "It is 2.\n#### 2",
            "followup": "A: and 3?\nB: It is 3. The answer is \\ANSWER{3}."}
    src = tmp_path / "follow_up.jsonl"
    src.write_text(json.dumps(line) + "\n{bad\n")
    out = tmp_path / "converted.jsonl"
    assert main(["convert-mathchat", "--input", str(src), "--out", str(out), "--strict"]) == 2
    assert "follow_up.jsonl line 2: not valid JSON" in capsys.readouterr().err
    assert main(["convert-mathchat", "--input", str(src), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "skipped: " in captured.err and "skipped 1" in captured.out
    assert len(load_conversations(out).conversations) == 1


def test_user_errors_are_one_line(tmp_path, capsys):
    assert main(["sample", "--dry-run"]) == 2
    assert "give --data" in capsys.readouterr().err
    assert main(["sample", "--depth-table", "1:x", "--dry-run"]) == 2
    assert "DEPTH:COUNT" in capsys.readouterr().err
    assert main(["augment", "--data", "builtin:mathchat", "--out", str(tmp_path / "o.jsonl"),
                 "--base-url", "ftp://x", "--model", "m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "http://" in err[0]
    assert main(["stats", "--data", str(tmp_path / "missing.jsonl"), "--tokenizer", "none"]) == 2
    assert "data file not found" in capsys.readouterr().err
