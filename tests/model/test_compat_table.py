"""``make test-compat``'s pieces: which failure is a promised refusal, and the table read from JUnit reports."""

from __future__ import annotations

import pytest

from compat_table import arch_of, main, table
from conftest import promised_refusal
from onepass.model.couplings import CouplingError
from onepass.model.tiny import ArchitectureAbsent


def test_a_refusal_naming_a_newer_release_is_promised_and_nothing_else_is():
    assert promised_refusal(CouplingError("X (transformers 5.2.0) ...; use transformers>=99.1")).startswith("refused: X")
    assert promised_refusal(CouplingError("X ...; use transformers>=5.0")) is None  # the installed release works
    assert promised_refusal(CouplingError("two\nlines; use transformers>=99.1")) is None  # not one line
    assert promised_refusal(ValueError("use transformers>=99.1")) is None  # not a refusal
    assert promised_refusal(ArchitectureAbsent("transformers 5.2.0 has no NemotronHConfig")).startswith("absent: ")


REPORT = """<testsuites><testsuite>
<testcase classname="tests.test_architectures" name="test_loss[qwen3]"/>
<testcase classname="tests.test_architectures" name="test_loss[qwen3-window]"><failure message="1e-3"/></testcase>
<testcase classname="tests.rl.test_exactness" name="test_lp[qwen3.5-None]"><skipped message="refused: Qwen3_5 ... use transformers&gt;=5.21"/></testcase>
<testcase classname="tests.test_guard" name="test_twin[nemotron-h]"><skipped message="absent: no NemotronHConfig"/></testcase>
<testcase classname="tests.test_couplings" name="test_private_names"/>
</testsuite></testsuites>"""


def test_the_table_names_each_architecture_per_release_and_fails_on_any_failure(tmp_path, capsys):
    assert [arch_of(n) for n in ("t[qwen3]", "t[qwen3-window]", "t[qwen3.5-None]", "t[160-gpt-oss]", "t", "t[x]")] \
        == ["qwen3", "qwen3-window", "qwen3.5", "gpt-oss", "(no architecture)", "(no architecture)"]
    report = tmp_path / "5.2.0.xml"
    report.write_text(REPORT)
    text, ok = table([report])
    rows = {line.split()[0]: line.split()[1] for line in text.splitlines()[1:] if line and not line.startswith(" ")
            and not line.startswith("5.2.0") and not line.startswith("(")}
    assert rows == {"qwen3": "exact", "qwen3-window": "FAIL", "qwen3.5": "refused", "nemotron-h": "absent"}
    assert not ok and "5.2.0: FAILED test_loss[qwen3-window]" in text and "[5.2.0] refused: Qwen3_5" in text
    assert main([str(report), str(tmp_path / "5.6.2.xml")]) == 1
    assert "no report: " in capsys.readouterr().out
    report.write_text(REPORT.replace('<failure message="1e-3"/>', ""))
    assert main([str(report)]) == 0
