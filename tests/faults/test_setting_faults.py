"""Settings that were refused although valid, ignored without a word, or answered untruly (issue 44, items 8 and 14).

Before the fix (b757769): ``template_date: 2030-01-02`` in a YAML config (unquoted: YAML reads a date) and a
YAML timestamp were refused ("template_date must be a string"); ``--share-window`` without ``--pack`` (or with
``--no-share-prefix``, or under n-pass) was accepted and ignored, by ``prepare``, ``train`` and
``OnePassConfig``; ``stats.json`` held a ``shared`` section of zeros where docs/cli.md says it is absent (nothing
shared); a checkpoint that could not be written said "the previous checkpoint is kept" when there was none;
``max_batch_tokens: 1`` trained whole rows without a word that the cap cannot hold.
"""

from __future__ import annotations

import errno
import json

import pytest
import torch

from onepass.cli import main
from onepass.errors import ConfigError, OnePassError
from onepass.train.config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")

CHATS = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
         for i in range(3)]


def _chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    return path


@pytest.mark.parametrize("written,day", [("2030-01-02", "2030-01-02"), ("2030-01-02 10:30:00", "2030-01-02"),
                                         ("'2030-01-02'", "2030-01-02")])  # the quoted one: a reference
def test_a_yaml_date_or_timestamp_is_the_template_date(tmp_path, written, day):
    path = tmp_path / "run.yaml"
    path.write_text(f"tiny: qwen3\ndata: builtin:mathchat\ntemplate_date: {written}\n")
    assert load_config(path).data_config.template_date == day


def _prepare(tmp_path, capsys, *flags):
    code = main(["prepare", "--data", str(_chats(tmp_path)), "--tokenizer", "builtin:qwen3", "--out",
                 str(tmp_path / "out"), "--no-progress", *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("flags,why", [
    ((), "shares prefixes only in packed rows: add --pack"),
    (("--pack", "--max-tokens", "4096", "--no-share-prefix"), "does nothing with share_prefix false"),
    (("--pack", "--max-tokens", "4096", "--schedule", "n-pass"), "does nothing under n-pass")])
def test_a_share_window_nothing_reads_is_one_line(tmp_path, capsys, flags, why):
    code, out, err = _prepare(tmp_path, capsys, "--share-window", "4", *flags)
    assert code == 2 and not (tmp_path / "out").exists(), (out, err)
    assert err.strip().splitlines()[-1].startswith(f"onepass: error: share_window=4 {why}"), err
    with pytest.raises(ConfigError, match=f"share_window=4 {why.split(':')[0]}"):  # a run's config: the same line
        load_config(None, dict(tiny="qwen3", data="builtin:mathchat", share_window=4,
                               **({"pack": True, "max_tokens": 4096} if flags else {}),
                               **({"share_prefix": False} if "--no-share-prefix" in flags else {}),
                               **({"schedule": "n-pass"} if "n-pass" in flags else {})))


def test_onepassconfig_refuses_a_share_window_without_packing(tmp_path):
    from onepass.train import OnePassConfig

    with pytest.raises(ConfigError, match="share_window=4 shares prefixes only in packed rows: add packing=True"):
        OnePassConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, share_window=4)
    OnePassConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, share_window=4, packing=True,
                  max_length=512)  # packing: read


def test_stats_json_has_no_shared_section_when_nothing_was_shared(tmp_path, capsys):
    code, out, err = _prepare(tmp_path, capsys, "--pack", "--max-tokens", "4096")  # three short chats: no prefix
    assert code == 0, (out, err)
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert "shared" not in stats, stats.get("shared")
    assert "shared prefixes" not in out


def _train(tmp_path, log, **overrides):
    from onepass.train.run.loop import train

    values = dict(tiny="qwen3", data="builtin:mathchat", limit=2, max_steps=1, progress=False, save_model=False,
                  output_dir=str(tmp_path / "run"))
    return train(load_config(None, values | overrides), log=log)


def _full_disk_at(monkeypatch, step_name):
    real = torch.save

    def full(obj, f, *a, **kw):
        name = str(getattr(f, "name", f))
        if step_name in name and name.endswith("scheduler.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", full)


def test_a_full_disk_at_the_first_checkpoint_claims_no_previous_one(tmp_path, monkeypatch):
    _full_disk_at(monkeypatch, "step-000001")
    with pytest.raises(OnePassError) as info:
        _train(tmp_path, log=lambda _m: None)
    message = str(info.value)
    assert "(No space left on device)" in message and "previous checkpoint" not in message, message
    assert message.endswith("there is no earlier checkpoint to resume from: free space and run again"), message


def test_a_full_disk_at_a_later_checkpoint_names_the_one_kept(tmp_path, monkeypatch):
    _full_disk_at(monkeypatch, "step-000002")
    with pytest.raises(OnePassError, match=r"the previous checkpoint \(step-000001\) is kept: free space and --resume"):
        _train(tmp_path, log=lambda _m: None, max_steps=2, save_steps=1)


def test_a_batch_token_cap_that_cannot_hold_a_row_is_said(tmp_path):
    said = []
    _train(tmp_path, log=said.append, max_batch_tokens=1)
    notes = [m for m in said if "max_batch_tokens=1" in m]
    assert notes and notes[0].startswith("note: max_batch_tokens=1 cannot hold 2 of 2 trees (the longest "), said
