"""``onepass eval``: scores checked exactly with a scripted generator, prompts checked per history mode.

The fake generator answers by the last user message of the prompt it gets (its
replies are known in advance), so every accuracy below is worked out by hand.
Reference answers carry ``REF-*`` markers and the fake's replies ``MODEL-*``
markers: what a prompt contains says which history the model was given, and
whether earlier reasoning was dropped as at inference.
"""

from __future__ import annotations

import importlib.util
import json
import threading

import pytest

from local_server import JSONHandler, LocalServer

from onepass.cli import main
from onepass.conversation.parse import parse_record
from onepass.data.sources import load_conversations
from onepass.evaluate.answers import answers_match, extract_answer, normalize_answer
from onepass.evaluate.generate import OpenAIChatGenerator, OpenAIGenerator
from onepass.evaluate.report import markdown, summarize
from onepass.evaluate.run import NO_ANSWER, NO_REFERENCE, UNFINISHED, evaluate, split_reply, template_prompt
from onepass.render import render_texts


def conv(cid: str, turns: list[tuple[str, str, str]]) -> dict:
    msgs = []
    for user, reasoning, content in turns:
        msgs += [{"role": "user", "content": user},
                 {"role": "assistant", "content": content, "reasoning_content": reasoning}]
    return {"id": cid, "messages": msgs}


RECORDS = [
    conv("A", [("2+2?", "REF-A1-THOUGHT", "REF-A1. The answer is 4."),
               ("times 10?", "REF-A2-THOUGHT", "REF-A2. The answer is 40.")]),
    conv("B", [("5-3?", "REF-B1-THOUGHT", "REF-B1. The answer is 2."),
               ("plus 1,000?", "REF-B2-THOUGHT", "REF-B2. The answer is 1,002."),
               ("halve it", "REF-B3-THOUGHT", r"REF-B3. The answer is \boxed{501}.")]),
    conv("C", [("1/2 as a decimal?", "REF-C1-THOUGHT", "REF-C1. The answer is 0.5.")]),
    conv("D", [("eggs?", "REF-D1-THOUGHT", "REF-D1. So, she must make $20 every day."),  # no final answer
               ("try again", "REF-D2-THOUGHT", "REF-D2. The answer is $18.")]),
]

# The model's replies, by the user message they answer. Right or wrong as marked.
SCRIPT = {
    "2+2?": "<think>\nMODEL-A1-THOUGHT\n</think>\n\nMODEL-A1: the answer is 4.",  # right
    "times 10?": "<think>\nMODEL-A2-THOUGHT\n</think>\n\nMODEL-A2: the answer is 41.",  # wrong
    "5-3?": "<think>\nMODEL-B1-THOUGHT\n</think>\n\nMODEL-B1: the answer is 2.0",  # right (2.0 = 2)
    "plus 1,000?": "<think>\nMODEL-B2-THOUGHT, never closed",  # cut off: no answer, wrong
    "halve it": "<think>\nMODEL-B3-THOUGHT\n</think>\n\nMODEL-B3: the answer is 501",  # right
    "1/2 as a decimal?": r"<think>\nMODEL-C1-THOUGHT\n</think>\n\nMODEL-C1 \(\boxed{\frac{1}{2}}\)",  # right
    "eggs?": "<think>\nMODEL-D1-THOUGHT\n</think>\n\nMODEL-D1: the answer is 20.",  # unscored
    "try again": "<think>\nMODEL-D2-THOUGHT\n</think>\n\nMODEL-D2: The answer is 18",  # right
}


def last_user(prompt: str) -> str:
    return prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


class ScriptedGenerator:
    """Replies from SCRIPT; keeps every call's prompts."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def generate(self, prompts: list[str]) -> list[str]:
        self.calls.append(list(prompts))
        return [SCRIPT[last_user(p)] for p in prompts]

    def prompt_for(self, user: str) -> str:
        (prompt,) = [p for call in self.calls for p in call if last_user(p) == user]
        return prompt


@pytest.fixture(scope="module")
def convs():
    return [parse_record(r, source="hand", index=i) for i, r in enumerate(RECORDS)]


@pytest.fixture(scope="module", params=["reference", "model"])
def run(request, convs, qwen3_tokenizer):
    fake = ScriptedGenerator()
    results = evaluate(convs, fake, template_prompt(qwen3_tokenizer), history=request.param)
    return request.param, fake, results


def test_turns_are_batched_across_conversations(run):
    _, fake, results = run
    assert [len(c) for c in fake.calls] == [4, 3, 1]  # turn 1 of A B C D, turn 2 of A B D, turn 3 of B
    assert [(r.id, r.turn) for r in results] == [("A", 1), ("B", 1), ("C", 1), ("D", 1),
                                                 ("A", 2), ("B", 2), ("D", 2), ("B", 3)]


def test_scores_per_turn_and_per_depth_exactly(run):
    _, _, results = run
    got = {(r.id, r.turn): (r.predicted, r.reference, r.correct, r.note) for r in results}
    assert got == {
        ("A", 1): ("4", "4", True, None), ("A", 2): ("41", "40", False, None),
        ("B", 1): ("2.0", "2", True, None), ("B", 2): (None, "1,002", False, UNFINISHED),
        ("B", 3): ("501", "501", True, None), ("C", 1): (r"\frac{1}{2}", "0.5", True, None),
        ("D", 1): ("20", None, None, NO_REFERENCE), ("D", 2): ("18", "$18", True, None)}
    s = summarize(results)
    assert (s["conversations"], s["turns"], s["scored"], s["correct"], s["no_answer"], s["unscored"]) == \
        (4, 8, 7, 5, 1, 1)
    assert s["accuracy"] == 5 / 7
    assert [(c["turn"], c["correct"], c["scored"], c["accuracy"]) for c in s["per_turn"]] == \
        [(1, 3, 3, 1.0), (2, 1, 3, 1 / 3), (3, 1, 1, 1.0)]
    depths = {d["depth"]: d for d in s["per_depth"]}
    assert sorted(depths) == [1, 2, 3]
    assert (depths[1]["conversations"], depths[1]["correct"], depths[1]["scored"], depths[1]["all_correct"]) == \
        (1, 1, 1, 1.0)
    assert (depths[2]["conversations"], depths[2]["correct"], depths[2]["scored"], depths[2]["all_correct"]) == \
        (2, 2, 3, 0.5)  # A is wrong at turn 2; D's only scored turn is right
    assert [(c["turn"], c["correct"], c["scored"], c["unscored"]) for c in depths[2]["per_turn"]] == \
        [(1, 1, 1, 1), (2, 1, 2, 0)]
    assert (depths[3]["correct"], depths[3]["scored"], depths[3]["no_answer"], depths[3]["all_correct"]) == \
        (2, 3, 1, 0.0)
    table = markdown(s)
    assert "| 2 | 33.3% | 1 | 3 | 1 | 0 |" in table  # turn 2: accuracy, correct, scored, no answer, unscored
    assert "| 2 | 2 | 100.0% | 50.0% |  | 66.7% | 50.0% |" in table  # depth 2 row


def test_history_holds_the_reference_or_the_models_own_answers(run):
    mode, fake, _ = run
    a2, b3, d2 = (fake.prompt_for(u) for u in ("times 10?", "halve it", "try again"))
    if mode == "reference":
        assert "REF-A1." in a2 and "MODEL-A1" not in a2
        assert "REF-B1." in b3 and "REF-B2." in b3 and "MODEL-B" not in b3
    else:
        assert "MODEL-A1: the answer is 4." in a2 and "REF-A1" not in a2
        assert "MODEL-B1: the answer is 2.0" in b3 and "REF-B" not in b3
        # the cut-off turn B2 is all reasoning: it enters the history as an empty answer
        assert "plus 1,000?<|im_end|>\n<|im_start|>assistant\n<|im_end|>" in b3
        assert "MODEL-D1: the answer is 20." in d2
    for prompt in (a2, b3, d2):  # earlier reasoning is dropped by the template, as at inference
        assert "THOUGHT" not in prompt and "<think>" not in prompt


def test_reference_prompts_are_the_training_prompts(qwen3_tokenizer):
    """In reference mode turn k's prompt is exactly what onepass trains turn k on."""
    sample = load_conversations("builtin:mathchat", limit=6).conversations
    convs = sample + [parse_record(r) for r in RECORDS]
    seen: list[str] = []

    class Echo:
        def generate(self, prompts):
            seen.extend(prompts)
            return ["" for _ in prompts]

    results = evaluate(convs, Echo(), template_prompt(qwen3_tokenizer), history="reference")
    by_turn = {(r.conversation, r.message): p for r, p in zip(results, seen)}
    expected = {(i, k): prompt for i, c in enumerate(convs) for k, prompt, _ in render_texts(c, qwen3_tokenizer)}
    assert by_turn == expected
    assert all(r.note in (NO_ANSWER, NO_REFERENCE) and not r.correct for r in results)  # empty replies


@pytest.mark.parametrize("text, answer", [
    ("The answer is 18.", "18"),
    ("So, the answer is 30 elves left.", "30 elves left"),
    ("First the answer is 3. Then, correcting: the final answer is: 5.", "5"),
    (r"The answer is \(\boxed{20}\).", "20"),
    (r"so \boxed{\frac{\sqrt{2}}{2}} and then \boxed{x^{2}+\frac{1}{2}}", r"x^{2}+\frac{1}{2}"),
    (r"\boxed{\text{unclosed", None),
    ("I am not sure.", None),
    ("", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_user_regex_replaces_the_default_rules():
    assert extract_answer("The answer is 3. ANSWER: 7 ANSWER: 9", r"ANSWER:\s*(\d+)") == "9"
    assert extract_answer("The answer is 3.", r"ANSWER:\s*(\d+)") is None  # no fallback to the defaults
    assert extract_answer("result=12;", r"result=\d+") == "result=12"  # no group: the whole match
    with pytest.raises(ValueError, match="not a valid regular expression"):
        extract_answer("x", "(")


@pytest.mark.parametrize("a, b, same", [
    ("1,000", "1000", True), ("3.0", "3", True), (r"\frac{1}{2}", "0.5", True), ("1/2", r"\dfrac{1}{2}", True),
    ("$49.50", "49.5 dollars", True), ("60%", "60", True), (r"\(\text{120}\)", "120", True),
    ("-4", "- 4", False), ("0.333", "1/3", False), ("Paris", "paris.", True), ("2", "3", False),
])
def test_answers_compare_minimally(a, b, same):
    assert answers_match(a, b) is same
    assert answers_match(None, b) is False


def test_split_reply():
    assert split_reply("<think>\nr\n</think>\n\nc") == ("r", "c", True)
    assert split_reply("<think>\nr never ends") == ("r never ends", "", False)
    assert split_reply("plain answer") == (None, "plain answer", True)
    assert normalize_answer("  Forty  Two. ") == "forty two"


def test_user_regex_through_evaluate(convs, qwen3_tokenizer):
    class Fake:
        def generate(self, prompts):
            return ["ANSWER: 4" for _ in prompts]

    results = evaluate(convs[:1], Fake(), template_prompt(qwen3_tokenizer), answer_regex=r"(?:answer is|ANSWER:) (\d+)")
    assert [(r.predicted, r.reference, r.correct) for r in results] == [("4", "4", True), ("4", "40", False)]


class FakeServer(LocalServer):
    """/v1/completions and /v1/chat/completions on 127.0.0.1; the first request fails with 500."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, dict]] = []
        self.lock, self.failed = threading.Lock(), False
        server = self

        class Handler(JSONHandler):
            def do_POST(self):
                body = self.read_json()
                with server.lock:
                    server.bodies.append((self.path, body))
                    first, server.failed = not server.failed, True
                if first:
                    return self.send_json(500, {"error": "boom"})
                if self.path.endswith("/chat/completions"):
                    text = SCRIPT[body["messages"][-1]["content"]]
                    return self.send_json(200, {"choices": [{"message": {"role": "assistant", "content": text}}]})
                return self.send_json(200, {"choices": [{"text": SCRIPT[last_user(body["prompt"])]}]})

        self.start(Handler)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_openai_compatible_server(endpoint, convs, qwen3_tokenizer):
    server = FakeServer()
    try:
        cls = OpenAIGenerator if endpoint == "completions" else OpenAIChatGenerator
        gen = cls(server.url, "served", max_new_tokens=64, concurrency=2, retries=2, backoff=0.01, timeout=5)
        results = evaluate(convs, gen, template_prompt(qwen3_tokenizer), history="model")
    finally:
        server.close()
    assert summarize(results)["correct"] == 5  # the same scripted replies, the same scores
    paths = {path for path, _ in server.bodies}
    assert paths == {f"/v1/{'completions' if endpoint == 'completions' else 'chat/completions'}"}
    assert len(server.bodies) == 9  # 8 turns + the one retried after HTTP 500
    body = next(b for _, b in server.bodies if "halve it" in json.dumps(b))
    assert body["model"] == "served" and body["max_tokens"] == 64 and body["temperature"] == 0.0
    if endpoint == "completions":  # the prompt is ours, rendered with the model's template
        assert "messages" not in body and last_user(body["prompt"]) == "halve it"
        assert "MODEL-B1: the answer is 2.0" in body["prompt"]
    else:  # messages, no reasoning sent back, no JSON mode
        assert "response_format" not in body
        assert [m["role"] for m in body["messages"]] == ["user", "assistant"] * 2 + ["user"]
        assert all("reasoning_content" not in m for m in body["messages"])
        assert body["messages"][1]["content"] == "MODEL-B1: the answer is 2.0"


def test_eval_command_on_the_bundled_sample_writes_the_report(tmp_path):
    out = tmp_path / "eval"
    assert main(["eval", "--tiny", "qwen3", "--data", "builtin:mathchat", "--limit", "2",
                 "--max-new-tokens", "4", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["history"] == "reference" and summary["settings"]["max_new_tokens"] == 4
    assert summary["conversations"] == 2 and summary["turns"] == 6
    assert [c["turn"] for c in summary["per_turn"]] == [1, 2, 3]
    assert [d["depth"] for d in summary["per_depth"]] == [3]
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 6 and {p["reference"] for p in preds} == {"18", "14", "3", "6", "12"}
    assert all(p["correct"] is (p["predicted"] is not None and answers_match(p["predicted"], p["reference"]))
               for p in preds)
    table = (out / "accuracy.md").read_text()
    assert "| turn | accuracy |" in table and "| depth | conversations | turn 1 | turn 2 | turn 3 |" in table
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_errors_are_one_line(tmp_path, capsys):
    if importlib.util.find_spec("vllm") is None:
        assert main(["eval", "--data", "builtin:mathchat", "--model", str(tmp_path), "--tokenizer", "builtin:qwen3",
                     "--backend", "vllm", "--limit", "1", "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("onepass: error: --backend vllm needs vLLM") and "\n" not in err
    assert main(["eval", "--data", "builtin:mathchat", "--model", "m", "--backend", "openai",
                 "--out", str(tmp_path / "o")]) == 2
    assert "--base-url" in capsys.readouterr().err
    assert main(["eval", "--data", "builtin:mathchat", "--tiny", "qwen3", "--answer-regex", "(",
                 "--limit", "1", "--max-new-tokens", "1", "--out", str(tmp_path / "o")]) == 2
    assert "not a valid regular expression" in capsys.readouterr().err


def test_hf_generator_batches_with_left_padding_like_one_at_a_time(qwen3_tokenizer, one_thread):
    """Greedy replies do not depend on the batch: left padding is masked, every prompt ends where
    generation starts. A reply stops at the end-of-turn token, which is not part of it."""
    import torch

    from onepass.evaluate.generate import HFGenerator
    from onepass.model.tiny import tiny_model

    model = tiny_model("qwen3", len(qwen3_tokenizer), dtype=torch.float64, seed=3)
    prompts = [template_prompt(qwen3_tokenizer)(c, 1) for c in load_conversations("builtin:mathchat", limit=3)
               .conversations] + ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]
    assert len({len(qwen3_tokenizer(p)["input_ids"]) for p in prompts}) == 4  # the batch needs padding
    one = HFGenerator(model, qwen3_tokenizer, max_new_tokens=6, batch_size=1).generate(prompts)
    batched = HFGenerator(model, qwen3_tokenizer, max_new_tokens=6, batch_size=4).generate(prompts)
    assert batched == one and all(one)
    gen = HFGenerator(model, qwen3_tokenizer, max_new_tokens=6)
    eos = qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = qwen3_tokenizer("The answer is 4.", add_special_tokens=False)["input_ids"]
    assert eos in gen.stop_ids
    assert gen._decode(ids + [eos] + ids) == "The answer is 4."


def test_replies_without_reasoning_are_counted_per_turn(convs, qwen3_tokenizer):
    """An empty <think></think> block or none at all is a reply without reasoning (issue 46: what a model
    trained on one rendering does where that rendering dropped the turn's reasoning)."""
    class Bare(ScriptedGenerator):
        def generate(self, prompts):
            replies = super().generate(prompts)
            return ["<think>\n\n</think>\n\nThe answer is 4." if last_user(p) == "2+2?" else
                    "The answer is 2." if last_user(p) == "5-3?" else r for p, r in zip(prompts, replies)]

    s = summarize(evaluate(convs, Bare(), template_prompt(qwen3_tokenizer)))
    assert [(c["turn"], c["no_reasoning"], c["turns"]) for c in s["per_turn"]] == [(1, 2, 4), (2, 0, 3), (3, 0, 1)]
    assert (s["no_reasoning"], s["correct"]) == (2, 5)
    assert "| 1 | 100.0% | 3 | 3 | 0 | 1 | 2 of 4 |" in markdown(s)

