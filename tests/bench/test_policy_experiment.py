"""The policy experiment's smoke run (benchmarks/policy_experiment.py --smoke, issue 46 item 2): every
policy trains and is evaluated turn by turn, the report is written, and the budgets are the ones each
policy's rendering implies (the keep-all single rendering trains exactly onepass's target tokens); a run
stopped early is reported from the cells it finished."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "policy_experiment.py"


@pytest.mark.e2e
def test_the_smoke_run_reports_every_policy_turn_by_turn(tmp_path, one_thread, monkeypatch):
    spec = importlib.util.spec_from_file_location("policy_experiment", SCRIPT)
    experiment = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "policy_experiment", experiment)  # its dataclasses look themselves up
    spec.loader.exec_module(experiment)
    assert experiment.main(["--smoke", "--out", str(tmp_path), "--threads", "1", "--jobs", "1"]) == 0
    report = json.loads((tmp_path / "policy.json").read_text())
    runs = {r["policy"]: r for r in report["runs"]}
    assert sorted(runs) == ["a", "b", "c", "d"]
    for r in runs.values():
        assert r["eval"]["reference"] and all(e["replies"] > 0 for e in r["eval"]["reference"].values())
        assert set(r["heldout_loss"]) == set(r["eval"]["reference"])
    targets = {p: r["targets_per_step"] for p, r in runs.items()}
    assert targets["b"] == targets["c"]  # every turn with its reasoning: the same completions, other contexts
    assert targets["a"] < targets["b"] and targets["d"] < targets["c"]
    assert runs["a"]["tokens_per_step"] < runs["b"]["tokens_per_step"]
    assert (tmp_path / "policy.png").stat().st_size > 0
    assert "| a | 1 |" in (tmp_path / "policy.md").read_text()
    # each cell was written as it ended: a stopped run is reported from them (--collect), and resumes
    assert sorted(p.name for p in (tmp_path / "cells").iterdir()) == [f"seed0-{p}.json" for p in "abcd"]
    (tmp_path / "cells" / "seed0-d.json").unlink()
    assert experiment.main(["--smoke", "--out", str(tmp_path), "--collect"]) == 0
    collected = json.loads((tmp_path / "policy.json").read_text())
    assert collected["runs"] == report["runs"][:3] and collected["missing"] == ["seed 0 policy d"]
    assert "**Not run** (the run was stopped): seed 0 policy d." in (tmp_path / "policy.md").read_text()
