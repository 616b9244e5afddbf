"""User errors are one line and exit 2; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import pytest

from onepass.errors import ConfigError, DataError, DataNotFound, OnePassError, UsageError, run_main


def _raising(error):
    def handler(args):
        raise error
    return handler


@pytest.mark.parametrize("error", [UsageError("--num must be >= 0, got -1"), ConfigError("no CUDA GPU"),
                                   DataError("x.jsonl line 3: not valid JSON"),
                                   DataNotFound("data file not found: x.jsonl")])
def test_a_user_error_is_one_line_and_exit_2(error, capsys, monkeypatch):
    monkeypatch.delenv("ONEPASS_DEBUG", raising=False)
    assert run_main(_raising(error), None) == 2
    assert capsys.readouterr().err == f"onepass: error: {error}\n"


def test_a_message_over_several_lines_is_still_one(capsys):
    assert run_main(_raising(DataError("first\nsecond")), None) == 2
    assert capsys.readouterr().err == "onepass: error: first second\n"


@pytest.mark.parametrize("error", [ValueError("shapes do not match"), FileNotFoundError("/tmp/x"),
                                   KeyError("input_ids"), RuntimeError("CUDA error")])
def test_anything_else_propagates(error, capsys):
    with pytest.raises(type(error)):
        run_main(_raising(error), None)
    assert capsys.readouterr().err == ""


def test_onepass_debug_raises_user_errors_and_interrupts(monkeypatch):
    monkeypatch.setenv("ONEPASS_DEBUG", "1")
    with pytest.raises(DataError):
        run_main(_raising(DataError("bad")), None)
    with pytest.raises(KeyboardInterrupt):
        run_main(_raising(KeyboardInterrupt()), None)
    monkeypatch.setenv("ONEPASS_DEBUG", "0")
    assert run_main(_raising(DataError("bad")), None) == 2


def test_interrupt_is_one_line_and_exit_130(capsys, monkeypatch):
    monkeypatch.delenv("ONEPASS_DEBUG", raising=False)
    assert run_main(_raising(KeyboardInterrupt()), None) == 130
    assert capsys.readouterr().err == "onepass: interrupted\n"


def test_the_status_of_a_handler_passes_through():
    assert run_main(lambda args: args, 0) == 0 and run_main(lambda args: args, 1) == 1


def test_every_user_error_class_is_a_onepass_error_and_keeps_its_old_bases():
    from onepass.attention.backends import BackendError
    from onepass.attention.cpu_tiles import CpuAttentionError
    from onepass.conversation.parse import ConversationError
    from onepass.data.augment import AugmentError
    from onepass.data.chat_client import FatalRequestError
    from onepass.data.mathchat import MathChatError
    from onepass.render import RenderError
    from onepass.render.tokenizer import TokenizerError
    from onepass.train.config import TrainConfigError

    for cls in (BackendError, CpuAttentionError, ConversationError, AugmentError, FatalRequestError,
                MathChatError, RenderError, TokenizerError, TrainConfigError, UsageError):
        assert issubclass(cls, OnePassError) and issubclass(cls, ValueError), cls
    assert issubclass(ConversationError, DataError) and issubclass(DataNotFound, FileNotFoundError)
