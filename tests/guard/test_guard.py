"""The exactness guard: a tiny float64 twin proves one-pass = N-pass for the user's model, or refuses.

Models are built from transformers' own config classes at their published sizes (the
twin must shrink them) and from :mod:`onepass.model.tiny`; the conversations are two bundled
MathChat ones with the real Qwen3 template. Hybrids (recurrent / convolutional layers)
stay refused until recurrent layers are laid out per tree (the next issue).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from onepass.guard import check as guard
from onepass.cli import main
from onepass.verify.divergence import first_differing
from onepass.guard import (
    TOLERANCE,
    builtin_conversations,
    InexactModelError,
    check_exact,
    enforce,
    sample_views,
    views_for_check,
)
from onepass.model.tiny import EXACT_ARCHS, HYBRID_ARCHS, TINY_ARCHS, ArchitectureAbsent, tiny_config, tiny_model
from onepass.guard.twin import kept_layers, tiny_twin
from onepass.model.couplings import CouplingError, mixer_classes
from onepass.model.layers import layer_types

pytestmark = pytest.mark.usefixtures("one_thread")

GOOD = {"messages": [{"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "4", "reasoning_content": "add"},
                     {"role": "user", "content": "and 3+3?"},
                     {"role": "assistant", "content": "6", "reasoning_content": "add again"}]}


def coupling_refusal(config) -> str | None:
    """The line the couplings refuse ``config``'s architecture with on the installed release (None: it loads), by
    their own detection (onepass.model.couplings.mixer_classes on the twin's modules, built on the meta device):
    a hybrid whose mixers read their states through the cache API before 5.21 is refused naming the release that
    works, and the tests expect that refusal there, not the verdict of the releases that load it."""
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(tiny_twin(config, vocab_size=300))
    try:
        mixer_classes(model.modules())
    except CouplingError as e:
        return str(e)
    return None


def assert_refused(result, refused: str, architecture: str) -> None:
    """``result`` is the couplings' refusal: one line, the coupling's own, naming the release that works."""
    assert not result.ok and result.refused and result.error == f"CouplingError: {refused}"
    line = result.message()
    assert "\n" not in line and line == f"one-pass is refused for {architecture}: {refused}"
    assert "use transformers>=" in line and "--allow-inexact" not in line  # allowing it would not run it
    for allow in (False, True):
        with pytest.raises(InexactModelError, match="one-pass is refused for"):
            enforce(result, allow_inexact=allow, log=lambda _: None)


@pytest.fixture(scope="module")
def views(qwen3_tokenizer):
    picked = sample_views(builtin_conversations(), qwen3_tokenizer)
    assert len(picked) == 2 and all(len(v) >= 2 for v in picked)  # trees, not single chains
    return picked


# ---------------------------------------------------------------------------------------------
# the twin


@pytest.mark.parametrize("num_layers,values,expected", [
    (48, {"layer_types": ["linear_attention"] * 3 + ["full_attention"]}, [0, 1, 2, 3]),  # Qwen3-Next: prefix
    (32, {"layer_types": ["full_attention"] * 28 + ["sliding_attention"] * 4}, [0, 28]),  # first of each
    (61, {"first_k_dense_replace": 3}, [0, 1, 2, 3]),  # DeepSeek: dense layers, then MoE
    (36, {}, [0, 1]),  # one kind of layer: two of them
    (6, {"mlp_only_layers": [4]}, [0, 1, 2, 3, 4]),
])
def test_twin_keeps_one_layer_of_every_kind(num_layers, values, expected):
    d = {k: (v * (num_layers // len(v)) if k == "layer_types" and len(v) < num_layers else v)
         for k, v in values.items()}
    assert kept_layers(d, num_layers) == expected


def built(name, **kwargs):
    """A transformers config by class name, built in the test (a release without the architecture: ArchitectureAbsent,
    reported as absent by tests/conftest.py, not a collection error)."""
    if not hasattr(tf, name):
        raise ArchitectureAbsent(f"transformers {tf.__version__} has no {name}")
    return getattr(tf, name)(**kwargs)


PUBLISHED = [  # transformers' own configs at their published sizes (the twin must shrink them)
    ("Qwen3NextConfig", {}), ("Qwen3Config", dict(use_sliding_window=True, sliding_window=4096, max_window_layers=28)),
    ("GptOssConfig", {}), ("Gemma3TextConfig", {}), ("DeepseekV3Config", {}), ("NemotronHConfig", {}),
    ("Lfm2Config", dict(full_attn_idxs=[2, 5, 8])), ("Qwen3MoeConfig", {}), ("FalconH1Config", {}),
]


@pytest.mark.parametrize("name,kwargs", PUBLISHED, ids=[n for n, _ in PUBLISHED])
def test_twin_is_small_same_class_same_layer_types_and_windows_bite(name, kwargs):
    config = built(name, **kwargs)
    before = config.to_dict()
    twin = tiny_twin(config, vocab_size=300)
    assert type(twin) is type(config) and config.to_dict() == before  # the user's config is untouched
    assert set(layer_types(twin)) == set(layer_types(config))
    assert twin.hidden_size <= 64 and twin.vocab_size == 300 and len(layer_types(twin)) <= 8
    assert twin.num_attention_heads % twin.num_key_value_heads == 0
    experts = next((getattr(twin, k) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                    if getattr(twin, k, None)), None)
    if experts is not None:
        assert experts <= 4 and twin.num_experts_per_tok <= experts
    if getattr(twin, "qk_rope_head_dim", None):  # derived as the class derives it (5.2's plain configs too)
        assert twin.head_dim == twin.qk_rope_head_dim
    if getattr(config, "sliding_window", None):  # a window wider than the test rows would hide a window bug
        assert twin.sliding_window == 8
    with torch.device("meta"):
        params = sum(p.numel() for p in tf.AutoModelForCausalLM.from_config(twin).parameters())
    assert params < 2_000_000


# ---------------------------------------------------------------------------------------------
# the verdict


@pytest.mark.parametrize("config", [tiny_config("qwen3", 64), tiny_config("llama", 64), tf.Qwen3Config(),
                                    tf.DeepseekV3Config()], ids=["tiny-qwen3", "tiny-llama", "qwen3", "deepseek-v3"])
def test_guard_passes_dense_models(config, views):
    result = check_exact(config, views)
    assert result.ok, result.message()
    assert result.rel_loss_diff <= TOLERANCE and result.error is None and result.num_views == 6
    assert result.message().startswith(f"one-pass is exact for {result.architecture}")


def test_guard_passes_packed_rows(views):
    result = check_exact(tiny_config("qwen3", 64), views, pack=True)
    assert result.ok and result.packed and result.max_rel_grad_diff <= TOLERANCE


@pytest.fixture
def unsupported_mixers(monkeypatch):
    """Recurrent mixers onepass cannot lay out on a tree (none detected): the guard must refuse them."""
    import onepass.mixers.tree

    monkeypatch.setattr(onepass.mixers.tree, "recurrent_mixer", lambda cls: None)


HYBRIDS = [  # (config, architecture, the layer type that differs, its mixer), run as unsupported mixers
    (("Qwen3NextConfig", {}), "Qwen3NextForCausalLM", "linear_attention", "GatedDeltaNet"),
    (("Qwen3_5TextConfig", {}), "Qwen3_5ForCausalLM", "linear_attention", "GatedDeltaNet"),
    (("Lfm2Config", dict(full_attn_idxs=[2, 5])), "Lfm2ForCausalLM", "conv", "ShortConv"),
    (("NemotronHConfig", dict(hybrid_override_pattern="M-M*-E")), "NemotronHForCausalLM", "linear_attention",
     "Mamba2"),
    (("GraniteMoeHybridConfig", dict(num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"])),
     "GraniteMoeHybridForCausalLM", "linear_attention", "Mamba"),
    (("FalconH1Config", dict(num_hidden_layers=2)), "FalconH1ForCausalLM", "hybrid", "FalconH1Mixer"),
]


@pytest.mark.parametrize("spec,architecture,layer_type,mixer", HYBRIDS, ids=[h[1] for h in HYBRIDS])
def test_guard_refuses_hybrids_in_one_line_naming_the_layer_type(spec, architecture, layer_type, mixer, views,
                                                                  unsupported_mixers):
    config = built(spec[0], **spec[1])
    result = check_exact(config, views)
    refused = coupling_refusal(config)
    if refused is not None:  # a release before the cache API: refused first, in the coupling's line
        return assert_refused(result, refused, architecture)
    assert not result.ok and result.error is None
    assert result.differing_layer_type == layer_type and mixer in result.mixer
    assert max(result.rel_loss_diff, result.max_rel_grad_diff) > 1e-6  # structural, not rounding
    with pytest.raises(InexactModelError) as e:
        enforce(result, allow_inexact=False, log=lambda _: None)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"one-pass is not exact for {architecture}: layer type {layer_type}")
    assert "--schedule n-pass" in line and "--allow-inexact" in line
    logged = []
    enforce(result, allow_inexact=True, log=logged.append)  # allowed: a warning, no error
    assert logged[0].startswith("warning: one-pass is not exact")


def test_mistral_with_a_small_sliding_window(views):
    """Mistral windows every layer. The guard must pass it once masks are cut per layer type
    (onepass.attention.backends.layer_windows, issue 11 items 1-2) and refuse it before."""
    from onepass.attention import backends

    result = check_exact(tf.MistralConfig(sliding_window=4096), views, backend="sdpa")
    if hasattr(backends, "layer_windows"):  # per-layer-type windowed masks are in
        assert result.ok, result.message()
    else:
        assert not result.ok and result.differing_layer_type == "sliding_attention"


def test_guard_catches_a_mask_that_ignores_the_window(views, monkeypatch):
    """The window shrinks to 8 tokens in the twin, so a mask without it differs on real conversations."""
    from onepass.attention import backends

    if hasattr(backends, "layer_windows"):
        monkeypatch.setattr(backends, "layer_windows", lambda config: {backends.ONE_MASK: None})
    result = check_exact(tf.MistralConfig(sliding_window=4096), views, backend="sdpa")
    assert not result.ok and result.differing_layer_type == "sliding_attention"
    assert result.message().startswith("one-pass is not exact for MistralForCausalLM: layer type sliding_attention")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_tiny_architecture_is_exact_or_refused(arch, views):
    """None is silently different: exact within 1e-9, or refused naming a recurrent layer type."""
    config = tiny_config(arch, 64)
    result = check_exact(config, views)
    refused = coupling_refusal(config)
    if refused is not None:  # a hybrid on a release before the cache API
        assert arch in HYBRID_ARCHS
        return assert_refused(result, refused, result.architecture)
    assert arch in EXACT_ARCHS + HYBRID_ARCHS and result.ok, result.message()  # hybrids: onepass.mixers


def test_a_twin_that_cannot_run_is_a_refusal_not_a_crash(views, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no float64 kernel\nsecond line")

    monkeypatch.setattr(guard, "build_twin", broken)
    result = check_exact(tf.Qwen3Config(), views)
    assert not result.ok and result.error == "RuntimeError: no float64 kernel"
    line = result.message()
    assert "\n" not in line and line.startswith("one-pass could not be checked for Qwen3ForCausalLM")


def test_a_coupling_refusal_is_one_line_whatever_allow_inexact(views, tmp_path, capsys, monkeypatch):
    """Played on any release: what transformers before 5.21 does to a hybrid (the couplings refuse it at model
    load). The guard gives the coupling's line whole (not cut at 300 characters: the release to use is at its
    end), enforce raises it with allow_inexact too, and verify's last line is still JSON."""
    import onepass.verify.check

    line = "Mixer (transformers 0.1) reads its recurrent states as " + "x" * 300 + "; use transformers>=5.21"

    def refuse(*args, **kwargs):
        raise CouplingError(line)

    monkeypatch.setattr(guard, "build_twin", refuse)
    assert_refused(check_exact(tf.Qwen3Config(), views), line, "Qwen3ForCausalLM")
    monkeypatch.setattr(onepass.verify.check, "run_verify", refuse)
    code, _, last = _verify(["--tiny", "qwen3"], tmp_path, capsys)
    assert code == 2 and last == {"equal": None, "refused": line, "model": "tiny qwen3", "dtype": "float64"}


def test_the_first_differing_layer_is_where_the_difference_starts():
    assert first_differing([1e-16, 2e-16]) is None
    assert first_differing([1e-16, 3e-2, 5e-2]) == 1  # layer 1 introduces it, layer 2 carries it on
    assert first_differing([2e-8, 1e-8, 4e-2]) == 2  # float32 noise before it is not the culprit
    assert first_differing([1e-3, 1.2e-3]) == 0


def test_views_for_check_prefers_the_users_multi_turn_conversations(qwen3_tokenizer):
    from onepass.conversation.parse import parse_record

    one_turn = parse_record({"messages": GOOD["messages"][:2]})
    two_turns = parse_record(GOOD)
    picked, where = views_for_check([one_turn, two_turns, two_turns], qwen3_tokenizer, source="chats.jsonl")
    assert [len(v) for v in picked] == [2, 2] and where == "2 conversations of chats.jsonl"
    picked, where = views_for_check([], qwen3_tokenizer, empty="the data is prepared rows")
    assert len(picked) == 2 and where == "the bundled MathChat pair (the data is prepared rows)"
    short = sample_views([two_turns], qwen3_tokenizer, max_view_tokens=len(picked[0][0]) - 1)
    assert all(len(v) < len(picked[0][0]) for c in short for v in c)


# ---------------------------------------------------------------------------------------------
# through the public paths


def _train(argv, tmp_path):
    return main(["train", "--data", "builtin:mathchat", "--limit", "2", "--max-steps", "1", "--no-progress",
                 "--output-dir", str(tmp_path / "run"), *argv])


def test_train_refuses_a_hybrid_in_one_line_and_trains_it_with_allow_inexact(tmp_path, capsys, unsupported_mixers):
    refused = coupling_refusal(tiny_config("lfm2", 64))
    if refused is not None:  # a release before the cache API: refused, --allow-inexact or not, nothing written
        for allow in ([], ["--allow-inexact"]):
            assert _train(["--tiny", "lfm2", *allow], tmp_path) == 2
            err = [line for line in capsys.readouterr().err.strip().splitlines()
                   if not line.startswith(("parallelism: ", "exactness guard on "))]
            assert err == [f"onepass: error: one-pass is refused for Lfm2ForCausalLM: {refused}"], err
            assert not (tmp_path / "run").exists()
        return
    assert _train(["--tiny", "lfm2"], tmp_path) == 2
    # the first log line says what runs (issue 26); then the refusal, one line, no traceback
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("parallelism: ")]
    assert len(err) == 1 and err[0].startswith("onepass: error: one-pass is not exact for Lfm2ForCausalLM: "
                                               "layer type conv (Lfm2ShortConv)"), err
    assert not (tmp_path / "run").exists()  # refused before anything was written

    assert _train(["--tiny", "lfm2", "--allow-inexact"], tmp_path) == 0
    assert "warning: one-pass is not exact for Lfm2ForCausalLM" in capsys.readouterr().err  # logging: stderr
    exactness = json.loads((tmp_path / "run" / "metrics.json").read_text())["exactness"]
    assert exactness["checked"] and not exactness["ok"] and exactness["differing_layer_type"] == "conv"
    assert exactness["data"] == "2 conversations of builtin:mathchat"


def test_train_records_a_passed_guard(tmp_path):
    assert _train(["--tiny", "qwen3"], tmp_path) == 0
    exactness = json.loads((tmp_path / "run" / "metrics.json").read_text())["exactness"]
    assert exactness["ok"] and exactness["architecture"] == "Qwen3ForCausalLM"
    assert exactness["rel_loss_diff"] <= TOLERANCE and exactness["max_rel_grad_diff"] <= TOLERANCE


def test_one_pass_trainer_refuses_a_hybrid(tmp_path, qwen3_tokenizer, unsupported_mixers):
    from transformers import TrainingArguments

    from onepass.conversation.parse import parse_record
    from onepass.train.trainer.trainer import OnePassTrainer, conversation_dataset

    train = conversation_dataset([parse_record(GOOD)] * 2, qwen3_tokenizer)
    model = tiny_model("lfm2", len(qwen3_tokenizer), attn_implementation="sdpa")
    args = TrainingArguments(str(tmp_path / "out"), max_steps=1, report_to=[], use_cpu=True, save_strategy="no")
    refused = coupling_refusal(model.config)
    if refused is not None:  # a release before the cache API: refused, allow_inexact or not
        for allow in (False, True):
            with pytest.raises(InexactModelError) as e:
                OnePassTrainer(model=model, args=args, train_dataset=train, allow_inexact=allow).train()
            assert str(e.value) == f"one-pass is refused for Lfm2ForCausalLM: {refused}"
        return
    with pytest.raises(InexactModelError, match="one-pass is not exact for Lfm2ForCausalLM: layer type conv"):
        OnePassTrainer(model=model, args=args, train_dataset=train).train()
    trainer = OnePassTrainer(model=model, args=args, train_dataset=train, allow_inexact=True)
    trainer.train()
    assert not trainer.exactness.ok and trainer.exactness.num_conversations == 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory, qwen3_tokenizer):
    """Tiny models saved as a user would have them: the real vocabulary, save_pretrained."""
    out = {}
    for arch in ("qwen3", "lfm2"):
        path = tmp_path_factory.mktemp(arch)
        tiny_model(arch, len(qwen3_tokenizer), tie_word_embeddings=True).save_pretrained(str(path))
        out[arch] = path
    return out


def _verify(argv, tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(GOOD) + "\n")
    code = main(["verify", "--data", str(data), *argv])
    out = capsys.readouterr().out.strip().splitlines()
    return code, out, json.loads(out[-1])


def test_verify_model_says_equal_for_a_saved_dense_model(saved, tmp_path, capsys):
    code, out, last = _verify(["--model", str(saved["qwen3"])], tmp_path, capsys)
    assert code == 0 and last["equal"] and "-> EQUAL" in out[-2]


def test_verify_model_names_the_layer_type_of_a_saved_hybrid(saved, tmp_path, capsys, unsupported_mixers):
    code, out, last = _verify(["--model", str(saved["lfm2"])], tmp_path, capsys)
    refused = coupling_refusal(tiny_config("lfm2", 64))
    if refused is not None:  # a release before the cache API: the last line is still JSON, with the refusal
        assert code == 2 and last["equal"] is None and last["refused"] == refused
        return
    assert code == 1 and not last["equal"] and last["layer_type"] == "conv" and last["mixer"] == "Lfm2ShortConv"
    assert out[-2].startswith("layer 0 (conv, Lfm2ShortConv) is the first whose output differs")


@pytest.mark.parametrize("arch,code", [("gpt-oss", 0), ("qwen3-next", 0)])
def test_verify_tiny_picks_a_backend_the_model_supports(arch, code, tmp_path, capsys):
    """gpt-oss refuses sdpa (attention sinks); Qwen3-Next has MoE experts (eager in float64) and is exact."""
    got, _, last = _verify(["--tiny", arch], tmp_path, capsys)
    refused = coupling_refusal(tiny_config(arch, 64))
    if refused is not None:  # a release before the cache API: the last line is still JSON, with the refusal
        assert got == 2 and last["equal"] is None and last["refused"] == refused
        return
    assert got == code and last["attention"] != "auto"
    if code:
        assert last["layer_type"] == "linear_attention"


def test_float32_steps_inside_a_float64_model_are_not_a_refusal(views):
    """Qwen3-MoE's router takes its softmax in float32: a shared node's summed gradient rounds
    differently there (~1e-8). Accepted only because every layer's output agrees within 1e-9."""
    result = check_exact(tf.Qwen3MoeConfig(), views)
    assert result.ok, result.message()
    if result.max_rel_grad_diff > TOLERANCE:
        assert result.max_layer_diff is not None and result.max_layer_diff <= TOLERANCE
        assert "float32 steps inside the model" in result.message()
