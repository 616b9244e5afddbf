"""Every dataset type SFTTrainer takes trains in OnePassTrainer with SFTTrainer's loss (TRL installed).

For each type, the same records go through TRL's ``SFTTrainer`` (its preparation, its collator, its
``compute_loss``) and through ``OnePassTrainer``'s preparation and the one-pass loss, on one float64 tiny
Qwen3 with the real Qwen3 vocabulary: the summed loss and the number of trained tokens are TRL's. A
conversation is the exception by design: its one-pass loss is SFTTrainer's on the conversation's per-turn
prompt-completion rows (what SFTTrainer needs to train each turn in the context the model sees then).
"""

from __future__ import annotations

import copy

import datasets
import pytest
import torch

from onepass.loss import ForwardView, batch_loss
from onepass.model.tiny import tiny_model
from onepass.train import OnePassConfig
from onepass.train.trainer.data import OnePassCollator
from onepass.train.trainer.records import as_rows
from onepass.layout.tree import COLUMNS

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.usefixtures("one_thread")

ZEN = ["Beautiful is better than ugly.", "Explicit is better than implicit.", "Simple is better than complex.",
       "Readability counts.", "Errors should never pass silently, unless explicitly silenced."]
PROMPTS = [("Beautiful is better", " than ugly."), ("Flat is better than", " nested."), ("Sparse", " is dense.")]
REASONING = {"messages": [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "reasoning_content": "Two and two make four.", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "reasoning_content": "Three and three make six.", "content": "6."},
    {"role": "user", "content": "And their sum?"},
    {"role": "assistant", "reasoning_content": "Four and six make ten.", "content": "10."}]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOLCALL = {"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "name": "get_weather", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."}], "tools": TOOLS}


@pytest.fixture(scope="module")
def model(qwen3_tokenizer):
    return tiny_model("qwen3", len(qwen3_tokenizer), dtype=torch.float64)


def _args(cls, tmp_path, **kw):
    return cls(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, **kw)


def trl_loss(records, model, tokenizer, tmp_path, formatting_func=None, **kw):
    """SFTTrainer's summed loss and number of trained tokens on ``records`` (its collator, its compute_loss)."""
    trainer = trl.SFTTrainer(model=copy.deepcopy(model), args=_args(trl.SFTConfig, tmp_path / "trl", **kw),
                             train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer,
                             formatting_func=formatting_func)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    count = int((batch["labels"][:, 1:] != -100).sum())
    with torch.no_grad():
        mean = trainer.compute_loss(trainer.model.eval(), batch, num_items_in_batch=torch.tensor(count))
    return float(mean) * count, count, trainer


def onepass_loss(records, model, tokenizer, tmp_path, formatting_func=None, packing=None, **kw):
    """OnePassTrainer's preparation and the one-pass loss: summed loss, trained tokens, the prepared dataset."""
    args = _args(OnePassConfig, tmp_path / "op", **kw)
    prepared = as_rows(datasets.Dataset.from_list(records), tokenizer, args, source="train_dataset",
                       formatting_func=formatting_func, packing=packing).dataset
    batch = OnePassCollator()([prepared[i] for i in range(len(prepared))])
    with torch.no_grad():
        total = batch_loss(ForwardView(model, model), batch)
    return float(total), int(batch["weights"].sum()), prepared


# TRL's fused LM head forms the log-probabilities in float32 (a float64 model's loss differs from the float64
# one-pass loss in the 8th digit); the one-pass side is float64 throughout
TOL = 1e-6


def rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def conversational_pc(record):
    """A conversation as SFTTrainer must be given it to train each turn in its own context: one
    prompt-completion row per assistant turn."""
    msgs = record["messages"]
    return [{"prompt": msgs[:i], "completion": [m], **({"tools": record["tools"]} if "tools" in record else {})}
            for i, m in enumerate(msgs) if m["role"] == "assistant"]


CASES = {
    "text": ([{"text": t} for t in ZEN], {}),
    "prompt_completion": ([{"prompt": p, "completion": c} for p, c in PROMPTS], {}),
    "prompt_completion_full_loss": ([{"prompt": p, "completion": c} for p, c in PROMPTS],
                                    {"completion_only_loss": False}),
    "conversational_prompt_completion": (conversational_pc(REASONING), {}),
    "pretokenized": ([{"input_ids": [3, 4, 5, 6, 7], "assistant_masks": [0, 0, 1, 1, 1]},
                      {"input_ids": [8, 9, 10], "assistant_masks": [0, 1, 1]}], {}),
    "pretokenized_completion_mask": ([{"input_ids": [3, 4, 5, 6, 7], "completion_mask": [0, 0, 0, 1, 1],
                                       "assistant_masks": [0, 1, 1, 1, 0]}], {"completion_only_loss": True}),
    "pretokenized_labels": ([{"input_ids": [3, 4, 5, 6], "labels": [-100, 4, -100, 6]}], {}),
    "messages_as_trl_renders_them": ([REASONING, TOOLCALL], {"assistant_only_loss": False}),
    "truncated": ([{"text": t} for t in ZEN], {"max_length": 6}),
    "packing_bfd": ([{"text": t} for t in ZEN], {"packing": True, "max_length": 16}),
    "packing_bfd_split": ([{"text": t} for t in ZEN], {"packing": True, "max_length": 8,
                                                      "packing_strategy": "bfd_split"}),
    "packing_wrapped": ([{"text": t} for t in ZEN], {"packing": True, "max_length": 8, "packing_strategy": "wrapped"}),
    "padding_free": ([{"text": t} for t in ZEN], {"padding_free": True, "max_length": None}),
    "dft": ([{"text": t} for t in ZEN], {"loss_type": "dft"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_trl_dataset_type_has_sfttrainers_loss(case, model, qwen3_tokenizer, tmp_path):
    records, kw = CASES[case]
    ours, n_ours, prepared = onepass_loss(records, model, qwen3_tokenizer, tmp_path, **kw)
    if kw.get("loss_type") == "dft":
        from onepass.loss import batch_dft_loss

        batch = OnePassCollator()([prepared[i] for i in range(len(prepared))])
        with torch.no_grad():
            ours = float(batch_dft_loss(ForwardView(model, model), batch))
    theirs, n_theirs, trainer = trl_loss(records, model, qwen3_tokenizer, tmp_path, **kw)
    assert n_ours == n_theirs > 0
    assert rel(ours, theirs) <= TOL, (ours, theirs)
    if not kw.get("packing"):  # one row per example, the labels TRL trains: trl 1.7 (make test-min's floor) keeps
        # whole rows in its dataset and truncates them in its collator (keep_start: the first max_length)
        cut = slice(None, kw.get("max_length")) if kw.get("truncation_mode", "keep_start") == "keep_start" \
            else slice(-kw["max_length"], None)
        assert prepared["labels"] == [labels[cut] for labels in trainer.train_dataset["labels"]]


def test_formatting_func_returning_text_is_language_modeling(model, qwen3_tokenizer, tmp_path):
    records = [{"chosen": "Flat.", "rejected": "Nested."}, {"chosen": "Sparse.", "rejected": "Dense."}]

    def fmt(example):
        return f"### Chosen: {example['chosen']}\n### Rejected: {example['rejected']}"

    ours, n_ours, _ = onepass_loss(records, model, qwen3_tokenizer, tmp_path, formatting_func=fmt)
    theirs, n_theirs, _ = trl_loss(records, model, qwen3_tokenizer, tmp_path, formatting_func=fmt)
    assert n_ours == n_theirs and rel(ours, theirs) <= TOL


def test_a_conversation_is_one_pass_with_sfttrainers_loss_on_its_turns(model, qwen3_tokenizer, tmp_path):
    """Qwen3 drops earlier turns' reasoning: the views differ, one tree holds them; its loss is SFTTrainer's
    on the per-turn prompt-completion rows, in fewer tokens than those rows."""
    ours, n_ours, prepared = onepass_loss([REASONING], model, qwen3_tokenizer, tmp_path)
    theirs, n_theirs, trainer = trl_loss(conversational_pc(REASONING), model, qwen3_tokenizer, tmp_path)
    assert n_ours == n_theirs and rel(ours, theirs) <= TOL
    assert len(prepared[0]["input_ids"]) < sum(len(x) for x in trainer.train_dataset["input_ids"])


def test_a_conversation_whose_views_are_prefixes_is_one_sequence(qwen3_tokenizer, tmp_path, with_template):
    """Without reasoning to drop (Qwen 2.5's ChatML), every view is a prefix of the next: one chain, as long as
    the conversation, every position its own depth."""
    template = (__import__("pathlib").Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    tok = with_template(template)
    record = {"messages": [{k: v for k, v in m.items() if k != "reasoning_content"} for m in REASONING["messages"]]}
    args = _args(OnePassConfig, tmp_path)
    row = as_rows(datasets.Dataset.from_list([record]), tok, args, source="train_dataset").dataset[0]
    full = tok.apply_chat_template(record["messages"], tokenize=True, return_dict=True)["input_ids"]
    assert row["input_ids"] == list(full)[:len(row["input_ids"])]
    assert row["position_ids"] == list(range(len(row["input_ids"])))
    assert set(row["kv_end"]) == {len(row["input_ids"])}


def test_a_mixed_dataset_trains_each_type_with_sfttrainers_loss(model, qwen3_tokenizer, tmp_path):
    """Text, prompt-completion and a multi-turn reasoning conversation in one dataset, one OnePassTrainer:
    each type's rows have SFTTrainer's loss on that type, and a step over all of them is their token mean."""
    from onepass.train import OnePassTrainer

    texts = [{"text": t} for t in ZEN[:3]]
    pcs = [{"prompt": p, "completion": c} for p, c in PROMPTS]
    keys = ("text", "prompt", "completion", "messages")  # one table: each row fills its own columns
    mixed = [{k: r.get(k) for k in keys} for r in texts + pcs + [REASONING]]
    trainer = OnePassTrainer(model=copy.deepcopy(model), processing_class=qwen3_tokenizer,
                             args=_args(OnePassConfig, tmp_path / "mixed", max_steps=1, learning_rate=1e-3,
                                        logging_steps=1, per_device_train_batch_size=len(mixed),
                                        gradient_checkpointing=False),
                             train_dataset=datasets.Dataset.from_list(mixed))
    rows = trainer.train_dataset
    assert len(rows) == len(mixed)
    expected = {}
    for name, records in (("text", texts), ("prompt_completion", pcs), ("conversation", conversational_pc(REASONING))):
        expected[name] = trl_loss(records, model, qwen3_tokenizer, tmp_path / name)[:2]
    # conversations come first, then TRL's rows in record order
    groups = {"conversation": [0], "text": [1, 2, 3], "prompt_completion": [4, 5, 6]}
    collate = OnePassCollator()
    total, count = 0.0, 0
    for name, idx in groups.items():
        batch = collate([{c: rows[i][c] for c in COLUMNS} for i in idx])
        with torch.no_grad():
            loss = float(batch_loss(ForwardView(model, model), batch))
        assert int(batch["weights"].sum()) == expected[name][1], name
        assert rel(loss, expected[name][0]) <= TOL, name
        total, count = total + loss, count + expected[name][1]
    batch = collate([{c: rows[i][c] for c in COLUMNS} for i in range(len(rows))])
    with torch.no_grad():
        step = trainer.compute_loss(trainer.model.eval(), batch, num_items_in_batch=batch["weights"].sum())
    assert rel(float(step), total / count) <= TOL
    trainer.model.train()
    trainer.train()
    assert rel(trainer.state.log_history[0]["loss"], total / count) <= 1e-6  # the logged loss: that step's


def test_per_record_chat_template_kwargs_apply_to_their_record_in_order(qwen3_tokenizer, tmp_path):
    """Mixed enable_thinking data: each record rendered with its own chat_template_kwargs, rows in record order."""
    conv = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    records = [{"messages": conv, "chat_template_kwargs": {"enable_thinking": flag}} for flag in (False, True, False)]
    rows = as_rows(datasets.Dataset.from_list(records), qwen3_tokenizer, _args(OnePassConfig, tmp_path),
                   source="train_dataset").dataset
    alone = {flag: as_rows(datasets.Dataset.from_list([{"messages": conv}]), qwen3_tokenizer,
                           _args(OnePassConfig, tmp_path, template_kwargs={"enable_thinking": flag}),
                           source="x").dataset[0]["targets"] for flag in (False, True)}
    assert alone[False] != alone[True]  # thinking off: the empty think block is prompt, not trained
    assert rows["targets"] == [alone[False], alone[True], alone[False]]


def test_trls_argument_checks_are_made(model, qwen3_tokenizer, tmp_path):
    from onepass.train import OnePassTrainer

    text = datasets.Dataset.from_list([{"text": t} for t in ZEN])

    def make(dataset=text, **kw):
        init = {k: kw.pop(k) for k in ("data_collator", "formatting_func", "peft_config") if k in kw}
        return OnePassTrainer(model=copy.deepcopy(model), args=_args(OnePassConfig, tmp_path, **kw),
                              train_dataset=dataset, processing_class=qwen3_tokenizer, **init)

    with pytest.raises(ValueError, match="`train_dataset` is required"):
        make(dataset=None)
    with pytest.raises(ValueError, match="`max_length` is not enforced"):
        make(padding_free=True, max_length=16)
    with pytest.raises(ValueError, match="custom data collator is not supported when using padding-free"):
        make(padding_free=True, max_length=None, data_collator=OnePassCollator())
    with pytest.raises(ValueError, match="`assistant_only_loss=True`, but the dataset is not conversational"):
        make(assistant_only_loss=True)
    with pytest.raises(ValueError, match="formatting function was provided while `completion_only_loss=True`"):
        make(completion_only_loss=True, formatting_func=lambda r: r["text"])
    with pytest.raises(ValueError, match="vision-related .* not seem to be a vision-language model"):
        make(dataset=datasets.Dataset.from_list([{"text": "a", "image": [1, 2]}]))
    with pytest.raises(ValueError, match=r"Dataset\.with_transform\(\).*skip_prepare_dataset.*trainer-ready"):
        make(dataset=text.with_transform(lambda b: b))
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        make(router_aux_loss_coef=0.1)
    with pytest.raises(TypeError, match="`peft_config` must be a `peft.PeftConfig`"):
        make(peft_config={"r": 8})
    trainer = make()
    assert {"trl", "sft"} <= set(trainer.model.model_tags) and trainer.aux_loss_enabled is False


def test_prompt_learning_peft_trains_trls_rows_and_refuses_a_tree(model, qwen3_tokenizer, tmp_path):
    from peft import PromptTuningConfig, TaskType

    from onepass.errors import UsageError
    from onepass.train import OnePassTrainer

    def make(records):
        return OnePassTrainer(model=copy.deepcopy(model).float(), train_dataset=datasets.Dataset.from_list(records),
                              args=_args(OnePassConfig, tmp_path, max_steps=1, gradient_checkpointing=False),
                              processing_class=qwen3_tokenizer,
                              peft_config=PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4))

    trainer = make([{"text": t} for t in ZEN])
    before = {n: p.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert any(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())
    with pytest.raises(UsageError, match="prompt-learning model .* a row holding a tree"):
        make([REASONING]).train()


def test_evaluate_prepares_a_raw_dataset_and_calls_compute_metrics(model, qwen3_tokenizer, tmp_path):
    """evaluate(eval_dataset=raw) prepares it as train_dataset was; compute_metrics gets the logits of every
    position and TRL-style labels, whose trained tokens are the rows' targets."""
    from onepass.train import OnePassTrainer

    seen = {}

    def metrics(pred):
        seen["shape"], seen["labels"] = pred.predictions.shape, pred.label_ids
        return {"my_metric": 0.5}

    trainer = OnePassTrainer(model=copy.deepcopy(model), processing_class=qwen3_tokenizer,
                             args=_args(OnePassConfig, tmp_path, per_device_eval_batch_size=8),
                             train_dataset=datasets.Dataset.from_list([{"text": t} for t in ZEN]),
                             compute_metrics=metrics)
    raw = datasets.Dataset.from_list([{"prompt": p, "completion": c} for p, c in PROMPTS])
    out = trainer.evaluate(eval_dataset={"pc": raw})
    theirs, count, _ = trl_loss([{"prompt": p, "completion": c} for p, c in PROMPTS], model, qwen3_tokenizer,
                                tmp_path)
    assert out["eval_pc_my_metric"] == 0.5 and rel(out["eval_pc_loss"], theirs / count) <= TOL
    assert seen["shape"][-1] == len(qwen3_tokenizer) and int((seen["labels"] != -100).sum()) == count


def test_dft_on_a_tree_is_sfttrainers_dft_on_the_turns(model, qwen3_tokenizer, tmp_path):
    """DFT weights each target's cross entropy by its own (detached) probability: views sharing a target share
    its context, so the tree's DFT loss is SFTTrainer's on the per-turn rows."""
    from onepass.loss import batch_dft_loss

    _, n_ours, prepared = onepass_loss([REASONING], model, qwen3_tokenizer, tmp_path, loss_type="dft")
    batch = OnePassCollator()([prepared[0]])
    with torch.no_grad():
        ours = float(batch_dft_loss(ForwardView(model, model), batch))
    theirs, n_theirs, _ = trl_loss(conversational_pc(REASONING), model, qwen3_tokenizer, tmp_path, loss_type="dft")
    assert n_ours == n_theirs and rel(ours, theirs) <= TOL


# Streams (issue 45.1, 44.2, 44.9): every type above, given as an IterableDataset, trains the rows the same
# records make as a map-style Dataset (at b757769 every stream but one of conversations was refused, "has no
# conversations", and a mixed stream dropped its non-conversation records).

def _streamed(records):
    return datasets.Dataset.from_list(records).to_iterable_dataset()


def _trainer_rows(dataset, tokenizer, tmp_path, **kw):
    from onepass.train.trainer.stream import trainer_rows

    args = _args(OnePassConfig, tmp_path, **kw)
    return trainer_rows(dataset, tokenizer, args, source="train_dataset", vocab_size=len(tokenizer)).dataset


def _items(dataset):
    return [{c: list(item[c]) for c in (*COLUMNS, "labels")} for item in dataset]


MIXED = ([{"text": t} for t in ZEN[:3]] + [{"prompt": p, "completion": c} for p, c in PROMPTS] + [REASONING])


@pytest.mark.parametrize("case", sorted(CASES) + ["conversations", "mixed"])
def test_a_streamed_dataset_trains_the_rows_of_the_map_style_dataset(case, model, qwen3_tokenizer, tmp_path):
    """The same records map-style and streamed (``Dataset.to_iterable_dataset()``): the same rows in the same
    order, so the same loss (and, by the test above, SFTTrainer's)."""
    records, kw = CASES.get(case, ([REASONING, TOOLCALL] if case == "conversations" else MIXED, {}))
    if case == "mixed":  # one table: each record fills its own columns, the others null
        keys = ("text", "prompt", "completion", "messages")
        records = [{k: r.get(k) for k in keys} for r in records]
    mapped = _items(_trainer_rows(datasets.Dataset.from_list(records), qwen3_tokenizer, tmp_path, **kw))
    streamed = _items(_trainer_rows(_streamed(records), qwen3_tokenizer, tmp_path, **kw))
    assert len(streamed) == len(mapped) > 0
    assert streamed == mapped
    collate = OnePassCollator()
    with torch.no_grad():
        losses = [float(batch_loss(ForwardView(model, model), collate(items))) for items in (mapped, streamed)]
    assert losses[0] == losses[1]


def _streams_refused(make_trainer) -> bool:
    """Below accelerate 1.13 (make test-min's floor) a stream is refused in one line when the trainer is made
    (its batch dispatcher cannot pass the rows' host copy): checked here, and True; else False (train it)."""
    from onepass.train.distributed import STREAM_ACCELERATE, accelerate_older_than
    from onepass.train.config import TrainConfigError

    if not accelerate_older_than(STREAM_ACCELERATE):
        return False
    with pytest.raises(TrainConfigError, match=rf"^a streamed dataset needs accelerate>={STREAM_ACCELERATE} "):
        make_trainer()
    return True


def test_a_streamed_json_file_of_each_type_trains_like_sfttrainer(model, qwen3_tokenizer, tmp_path):
    """A user's own JSONL read with ``load_dataset("json", streaming=True)`` (language modeling, issue 44.9, and
    conversational prompt-completion; the other types make the map-style rows, above), one OnePassTrainer
    step: the logged loss is SFTTrainer's on the same stream."""
    import json

    from onepass.train import OnePassTrainer

    records = {"text": CASES["text"][0],
               "conversational_prompt_completion": CASES["conversational_prompt_completion"][0]}
    if _streams_refused(lambda: OnePassTrainer(model=model, processing_class=qwen3_tokenizer, args=_args(
            OnePassConfig, tmp_path / "refused"), train_dataset=_streamed(records["text"]))):
        return
    for name, rows in records.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        losses = {}
        for cls, config in ((OnePassTrainer, OnePassConfig), (trl.SFTTrainer, trl.SFTConfig)):
            stream = datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)
            trainer = cls(model=copy.deepcopy(model), processing_class=qwen3_tokenizer, train_dataset=stream,
                          args=_args(config, tmp_path / name / cls.__name__, max_steps=1, logging_steps=1,
                                     learning_rate=1e-3, per_device_train_batch_size=len(rows),
                                     gradient_checkpointing=False, save_strategy="no"))
            trainer.train()
            losses[cls.__name__] = trainer.state.log_history[0]["loss"]
        assert rel(losses["OnePassTrainer"], losses["SFTTrainer"]) <= 1e-6, (name, losses)


def test_a_mixed_stream_trains_every_record(model, qwen3_tokenizer, tmp_path):
    """Issue 44.2: a stream of 10 text, 10 prompt-completion and 10 conversation records gives 30 rows, as the
    same records map-style (b757769: 10, the conversations; the rest dropped with a log line), and a step over
    all of them logs the map-style step's loss."""
    from onepass.train import OnePassTrainer

    keys = ("text", "prompt", "completion", "messages")
    convs = [{"messages": [{"role": "user", "content": f"What is {i}+{i}?"},
                           {"role": "assistant", "content": f"{2 * i}."}]} for i in range(10)]
    records = ([{"text": f"{ZEN[i % 5]} ({i})"} for i in range(10)]
               + [{"prompt": f"{PROMPTS[i % 3][0]} {i}", "completion": PROMPTS[i % 3][1]} for i in range(10)] + convs)
    records = [{k: r.get(k) for k in keys} for r in records]
    if _streams_refused(lambda: OnePassTrainer(model=model, processing_class=qwen3_tokenizer, args=_args(
            OnePassConfig, tmp_path / "refused"), train_dataset=_streamed(records))):
        return
    losses, rows = {}, {}
    for name, data in (("map", datasets.Dataset.from_list(records)), ("stream", _streamed(records))):
        trainer = OnePassTrainer(model=copy.deepcopy(model), processing_class=qwen3_tokenizer, train_dataset=data,
                                 args=_args(OnePassConfig, tmp_path / name, max_steps=1, logging_steps=1,
                                            per_device_train_batch_size=30, gradient_checkpointing=False,
                                            save_strategy="no"))
        rows[name] = len(list(trainer.train_dataset))
        trainer.train()
        losses[name] = trainer.state.log_history[0]["loss"]
    assert rows == {"map": 30, "stream": 30}
    assert losses["stream"] == losses["map"]


def test_a_packed_stream_shares_the_prefix_of_conversations_that_share_one(qwen3_tokenizer, tmp_path):
    """``packing=True, share_prefix=True`` on conversations with one system prompt and 4 tools: the stream and
    the map-style dataset merge them into shared trees (the prompt and tools once per row), the same rows and
    the same loss terms as unshared (b757769: neither path called the sharing code, the same tokens either way;
    main's fix for the map-style path, issue 44.4, left the stream unshared)."""
    from onepass.data.synthetic import AgentConfig, agent_record
    from onepass.layout.share import loss_terms, same_terms
    from onepass.layout.tree import row_from_columns

    small = AgentConfig(harnesses=1, prompt=(300,), tools=4, min_turns=1, max_turns=2, user=(4, 8), reasoning=(2, 5),
                        tool_result=(2, 6), answer=(2, 5), calls=(0, 1))
    records = [{k: v for k, v in agent_record(i, 7, small).items() if k != "harness"} for i in range(6)]
    out = {}
    for share in (True, False):
        kw = {"packing": True, "max_length": 8192, "share_prefix": share, "schedule": "one-pass"}
        for name, data in (("map", datasets.Dataset.from_list(records)), ("stream", _streamed(records))):
            out[name, share] = [row_from_columns(item) for item in _trainer_rows(data, qwen3_tokenizer, tmp_path, **kw)]
    tokens = {key: sum(len(r) for r in rows) for key, rows in out.items()}
    assert tokens["stream", True] == tokens["map", True] < 0.6 * tokens["stream", False], tokens
    as_lists = {key: [[list(map(int, getattr(r, c))) for c in COLUMNS] for r in rows] for key, rows in out.items()}
    assert as_lists["stream", True] == as_lists["map", True]
    assert same_terms(loss_terms(out["stream", True]), loss_terms(out["stream", False]))


def test_a_streamed_eval_dataset_has_the_map_style_loss(model, qwen3_tokenizer, tmp_path):
    """Streamed eval data of TRL's types, given at init or to evaluate(): the map-style eval loss."""
    from onepass.train import OnePassTrainer

    records = [{"text": None, **r} for r in CASES["prompt_completion"][0]] + \
              [{"prompt": None, "completion": None, **r} for r in CASES["text"][0]]
    if _streams_refused(lambda: OnePassTrainer(model=model, processing_class=qwen3_tokenizer, args=_args(
            OnePassConfig, tmp_path / "refused"), train_dataset=datasets.Dataset.from_list(records),
            eval_dataset={"stream": _streamed(records)})):
        return
    trainer = OnePassTrainer(model=copy.deepcopy(model), processing_class=qwen3_tokenizer,
                             train_dataset=datasets.Dataset.from_list(CASES["text"][0]),
                             eval_dataset={"stream": _streamed(records)},
                             args=_args(OnePassConfig, tmp_path, per_device_eval_batch_size=4))
    mapped = trainer.evaluate(eval_dataset=datasets.Dataset.from_list(records))["eval_loss"]
    assert trainer.evaluate(eval_dataset=_streamed(records))["eval_loss"] == pytest.approx(mapped, rel=1e-12)
    assert trainer.evaluate()["eval_stream_loss"] == pytest.approx(mapped, rel=1e-12)


def test_conversations_under_the_default_loss_say_it_once(model, qwen3_tokenizer, tmp_path, caplog, monkeypatch):
    """Issue 45.3: a conversation trains its assistant turns in OnePassTrainer, every token in SFTTrainer (by
    default); a script moved from SFTTrainer is told so at construction, in one line naming the setting, once
    (b757769: nothing said). Asking for either loss says nothing; data without conversations says nothing."""
    import logging

    from onepass.train import OnePassTrainer
    from onepass.train import hf_config

    monkeypatch.setattr(hf_config, "_WARNED", set())

    def lines():
        return [r.getMessage() for r in caplog.records if "assistant_only_loss" in r.getMessage()]

    caplog.set_level(logging.WARNING, logger="onepass")
    for setting in (True, False):
        _trainer_rows(datasets.Dataset.from_list([REASONING]), qwen3_tokenizer, tmp_path, assistant_only_loss=setting)
    _trainer_rows(_streamed(CASES["text"][0]), qwen3_tokenizer, tmp_path)
    assert lines() == []
    OnePassTrainer(model=copy.deepcopy(model), processing_class=qwen3_tokenizer, args=_args(OnePassConfig, tmp_path),
                   train_dataset=datasets.Dataset.from_list([REASONING, TOOLCALL]))
    _trainer_rows(_streamed([REASONING]), qwen3_tokenizer, tmp_path)
    assert len(lines()) == 1
    assert "SFTTrainer" in lines()[0] and "assistant_only_loss=False" in lines()[0]
    monkeypatch.setattr(hf_config, "_WARNED", set())  # a stream says it at construction too, before a step
    _trainer_rows(_streamed([REASONING]), qwen3_tokenizer, tmp_path)
    assert len(lines()) == 2
