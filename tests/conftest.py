"""Shared fixtures and markers. The suite runs offline on CPU, one thread per process; CUDA tests skip cleanly."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread per process, here and in every process a test starts (they inherit the environment): the models are
# tiny, and with pytest -n 2 on 2 cores two threads per worker only spin waiting on each other (a tiny float64
# verify took 7 s of CPU on two threads of a busy machine, 0.3 s on one). Set them to try more.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import tokenizer_cache  # noqa: E402
import warm  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """Each tokenizer folder read once per test process (ONEPASS_TESTS_COLD=1: every time); not in pytest-xdist's
    controller, which runs no test."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        tokenizer_cache.install()

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# The tests `make test-quick` leaves to `make test`: each took at least 1.5 s of CPU on one thread (per-test
# CPU, user+sys with children, pytest-xdist off; 2026-11-29), so that the inner loop fits 3 minutes on 2 cores.
# Marked slow here, in one measured table, rather than above each test: the files are being moved and renamed on
# other branches (tests/test_structure.py fails naming a row whose test is gone). A name with [...] marks that
# case only (the family's cheaper cases stay in test-quick), without it every case. Add a row: measure the test
# (`CPUPROF_OUT=/tmp/cpu pytest -p cpuprof -p no:xdist TEST` writes its CPU seconds: tests/cpuprof.py).
SLOW = {
    "attention/test_cpu_attention.py": ["test_verify_one_pass_equals_n_pass[qwen3]"],
    "attention/test_mask.py": ["test_every_flex_forward_asks_for_the_main_kernel"],
    "bench/test_bench.py": [
        "test_arch_reaches_every_job_and_the_summary",
        "test_hybrid_arch_times_a_qwen35_and_reports_state_passing",
        "test_shape_and_layers_run_the_cut_model_and_report_the_full_depth",
    ],
    "conversation/test_conversation.py": ["test_split_inline_reasoning_round_trips"],
    "conversation/test_train_turns.py": [
        "test_each_setting_gives_views_to_its_turns_only_and_counts_the_rest[all]",
        "test_prepare_and_verify_take_the_flag",
    ],
    "data/test_data_load.py": ["test_prepared_rows_are_recognised_by_their_columns_without_reading_them"],
    "data/test_data_parallel.py": [
        "test_early_stops_of_a_parallel_prepare_return",
        "test_parallel_equals_serial_on_the_bundled_sample",
        "test_parallel_stats_merge_every_count_on_every_vendored_template",
    ],
    "data/test_data_stats.py": ["test_stats_report_the_gpu_cost_model"],
    "evaluate/test_eval.py": [
        "test_eval_command_on_the_bundled_sample_writes_the_report",
        "test_eval_errors_are_one_line",
    ],
    "export/test_export.py": [
        "test_merged_logits_equal_the_adapter_models",
        "test_the_adapters_tokenizer_and_template_win",
    ],
    "faults/test_bad_text.py": [
        "test_a_template_that_does_not_compile_is_one_line_before_any_data_is_read",
        "test_a_template_that_raises_for_one_conversation_is_a_counted_skip",
        "test_data_stats_skips_a_lone_surrogate",
        "test_prepare_skips_bad_text_serial_and_parallel",
    ],
    "faults/test_clock_faults.py": [
        "test_a_template_that_draws_random_text_is_refused_in_one_line_before_the_data",
        "test_prepare_trains_no_empty_date",
        "test_the_word_random_in_a_string_comment_or_attribute_is_not_random_text",
    ],
    "faults/test_hyperparam_faults.py": ["test_a_negative_max_grad_norm_is_no_clipping_not_gradient_ascent"],
    "faults/test_output_faults.py": [
        "test_a_full_disk_during_export_leaves_no_half_folder",
        "test_export_never_overwrites_another_models_folder",
    ],
    "faults/test_prepare_faults.py": [
        "test_out_refuses_a_folder_of_unrelated_files",
        "test_stale_leftovers_of_dead_processes_are_cleaned",
    ],
    "faults/test_prepare_write_faults.py": [
        "test_a_file_size_limit_is_one_line_and_keeps_the_earlier_output",
        "test_a_full_disk_is_one_line_and_leaves_nothing",
        "test_an_unreadable_data_file_is_not_called_a_full_disk",
    ],
    "faults/test_record_fields.py": [
        "test_a_lenient_read_counts_the_record_and_strict_stops",
        "test_a_record_nested_900_deep_is_a_counted_skip_not_a_crash_in_the_template",
        "test_messages_after_the_last_assistant_turn_are_counted_and_reported",
    ],
    "faults/test_resume_faults.py": [
        "test_a_changed_chat_template_behind_the_same_path_is_refused",
        "test_changed_data_behind_the_same_path_is_refused",
    ],
    "faults/test_run_faults.py": ["test_prepared_rows_are_reported_with_the_schedule_they_were_prepared_with"],
    "faults/test_setting_faults.py": [
        "test_a_full_disk_at_the_first_checkpoint_claims_no_previous_one",
        "test_stats_json_has_no_shared_section_when_nothing_was_shared",
    ],
    "faults/test_skip_counts.py": ["test_the_reasons_add_up_to_the_views_skipped"],
    "faults/test_trainer_data_faults.py": ["test_conversations_whose_every_turn_has_weight_0_say_so_in_prepare"],
    "faults/test_trainer_faults.py": [
        "test_a_run_that_ends_with_non_finite_weights_says_so",
        "test_a_step_with_no_target_weight_trains_nothing_and_keeps_the_weights_finite",
        "test_a_streamed_broken_row_is_one_line_naming_the_item",
        "test_an_endless_iterable_dataset_streams",
        "test_evaluate_is_the_weighted_mean_whatever_the_eval_batch_size",
    ],
    "faults/test_verify_faults.py": [
        "test_every_record_skipped_is_an_error_not_equal",
        "test_verify_says_its_default_limit_cut_the_data",
        "test_verify_skips_the_turns_prepare_skips_and_checks_the_rest",
    ],
    "faults/test_verify_scope_faults.py": [
        "test_verify_pack_with_a_budget_checks_what_prepare_trains_and_says_what_it_left_out",
        "test_verify_with_every_view_over_the_budget_checked_nothing",
    ],
    "guard/test_guard.py": [
        "test_one_pass_trainer_refuses_a_hybrid",
        "test_verify_model_names_the_layer_type_of_a_saved_hybrid",
        "test_verify_model_says_equal_for_a_saved_dense_model",
        "test_verify_tiny_picks_a_backend_the_model_supports",
    ],
    "layout/test_geometry.py": ["test_depths_parents_and_ancestors_equal_the_reference"],
    "mixers/test_chains.py": ["test_chains_equal_the_reference_and_scanning_them_equals_every_path"],
    "mixers/test_hybrids.py": [
        "test_hybrid_loss_and_every_gradient_equal_n_pass[falcon-h1]",
        "test_hybrid_loss_and_every_gradient_equal_n_pass[granite-4-hybrid]",
        "test_hybrid_loss_and_every_gradient_equal_n_pass[nemotron-h]",
        "test_hybrid_loss_and_every_gradient_equal_n_pass[qwen3-next]",
        "test_hybrid_loss_and_every_gradient_equal_n_pass[qwen3.5]",
    ],
    "model/test_couplings.py": ["test_a_torch_without_the_cpu_flash_ops_imports_and_refuses_onepass_cpu_in_one_line"],
    "prepare/test_data_config.py": ["test_prepare_parses_the_schedule_once_per_run"],
    "prepare/test_prepare_share.py": [
        "test_data_stats_reports_the_shared_prefix_tokens_and_their_bound",
        "test_prepare_pack_shares_prefixes_with_the_same_loss_terms",
    ],
    "render/test_encode.py": [
        "test_an_added_token_that_strips_whitespace_turns_the_fast_path_off",
        "test_pieces_give_the_tokenizers_own_ids_on_bundled_and_synthetic_data[synthetic:mathchat-sync]",
        "test_special_tokens_encoded_as_text_turn_the_fast_path_off",
        "test_the_probe_is_redone_when_the_added_tokens_change",
        "test_vocab_size_is_len_and_the_render_never_builds_the_whole_vocabulary",
    ],
    "render/test_quirks.py": ["test_each_proving_test_exists"],
    "render/test_render.py": [
        "test_a_template_that_does_not_compile_is_one_line",
        "test_tokenizer_without_template_gets_the_builtin_chatml",
    ],
    "render/test_single_rendering.py": [
        "test_a_missing_single_template_is_one_line",
        "test_data_stats_prints_and_writes_them",
    ],
    "render/test_template_date.py": ["test_prepare_records_the_date_in_stats_json"],
    "test_cli.py": [
        "test_data_convert_mathchat",
        "test_every_data_spec_through_every_command[jsonl-prepare]",
        "test_prepare_counts_every_skip",
        "test_prepare_packed_rows_fit_the_budget",
        "test_show_writes_a_png",
        "test_template_that_cannot_split_names_the_turn",
        "test_user_errors_are_one_line[argv3-chat template file not found: nope.jinja]",
        "test_verify_names_its_device_and_refuses_a_backend_the_device_cannot_run",
        "test_verify_prints_json_last",
    ],
    "test_head.py": [
        "test_chunked_head_peak_does_not_grow_with_the_number_of_chunks",
        "test_chunked_head_peak_memory_is_far_below_the_logits",
    ],
    "test_share_exactness.py": [
        "test_onepass_verify_pack_says_equal_on_agent_data",
        "test_shared_rows_equal_n_pass_loss_and_every_gradient",
    ],
    "test_structure.py": [
        "test_models_and_configs_are_loaded_in_one_module_and_tokenizers_in_one",
        "test_one_dtype_table_and_one_conversion_to_a_torch_dtype",
    ],
    "test_tokenizer_cache.py": [
        "test_a_command_started_warm_finds_the_builtin_tokenizer_loaded",
        "test_a_copy_is_what_a_fresh_load_gives",
    ],
    "test_views_property.py": ["test_every_target_sees_exactly_its_view"],
    "train/test_hf_config.py": ["test_onepass_config_imports_without_trl"],
    "train/trainer/test_trainer.py": [
        "test_cpu_fast_backend_serves_the_trainer",
        "test_gradient_accumulation_equals_one_bigger_batch",
        "test_lora_model_trains_through_the_trainer",
        "test_one_pass_and_n_pass_take_the_same_steps_through_the_trainer",
    ],
    "train/trainer/test_sft_types.py": [
        "test_a_mixed_dataset_trains_each_type_with_sfttrainers_loss",
        "test_each_trl_dataset_type_has_sfttrainers_loss[conversational_prompt_completion]",
    ],
    "train/run/test_static_shapes.py": [
        "test_forwards_run_in_length_buckets_each_compiled_once",
        "test_length_buckets_keep_every_loss",
    ],
    "train/run/test_train.py": [
        "test_a_crash_leaves_a_checkpoint_to_resume_from",
        "test_a_prepared_directory_trains_row_by_row",
        "test_float32_curves_agree_closely",
        "test_micro_batching_does_not_change_the_steps",
        "test_one_pass_and_n_pass_take_the_same_20_steps_float64",
        "test_outputs_metrics_plot_tensorboard_and_model_with_tokenizer",
        "test_resume_from_a_checkpoint_continues_the_identical_losses",
        "test_two_runs_advanced_in_turn_take_the_steps_each_takes_alone",
    ],
    "train/run/test_train_cli.py": ["test_a_run_from_the_command_line"],
    "train/run/test_train_share.py": ["test_shared_prefixes_take_the_same_steps_with_fewer_tokens"],
    "parallel/test_layout.py": [
        "test_split_over_ranks_equals_one_process[falcon-h1-onepass_cpu-2]",
        "test_split_over_ranks_equals_one_process[nemotron-h-onepass_cpu-4]",
        "test_split_over_ranks_equals_one_process[qwen3.5-onepass_cpu-2]",
    ],
    "verify/test_verdict.py": [
        "test_verify_calls_a_gradient_rounded_past_the_tolerance_equal",
        "test_verify_says_different_past_rounding",
        "test_verify_without_differences_locates_nothing",
    ],
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("requires_cuda") and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
    mark_slow(config, items)


def mark_slow(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests :data:`SLOW` names ``slow`` (tests/test_structure.py checks that each row names a test)."""
    names = {f"tests/{path}::{name}" for path, tests in SLOW.items() for name in tests}
    for item in items:
        if item.nodeid in names or item.nodeid.split("[", 1)[0] in names:
            item.add_marker(pytest.mark.slow)


def promised_refusal(error: BaseException) -> str | None:
    """``"refused: <line>"`` for a one-line CouplingError (or the guard's refusal carrying one: what ``onepass
    train`` stops with) that names a transformers release newer than the installed one (what onepass promises
    on the older releases `make test-compat` and `make test-min` run), ``"absent: <line>"`` for an
    architecture the installed release does not have; None for anything else, which stays a failure (a refusal
    on a release it names as working is a regression)."""
    import re

    import transformers
    from packaging.version import Version

    from onepass.guard.check import InexactModelError
    from onepass.model.couplings import CouplingError
    from onepass.model.tiny import ArchitectureAbsent

    line = str(error)
    if isinstance(error, ArchitectureAbsent):
        return f"absent: {line}"
    needs = re.search(r"transformers>=(\d+\.\d+(?:\.\d+)?)", line)
    coupling = isinstance(error, CouplingError) or isinstance(error, InexactModelError) and \
        line.startswith("one-pass is refused for ")  # the guard's line for a CouplingError: onepass train's refusal
    if coupling and "\n" not in line and needs \
            and Version(transformers.__version__) < Version(needs.group(1)):
        return f"refused: {line}"
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test stopped by a promised refusal (:func:`promised_refusal`) is reported as skipped, with the line."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None and report.when in ("setup", "call"):
        reason = promised_refusal(call.excinfo.value)
        if reason is not None:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, reason)


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """The real Qwen3 vocabulary and chat template, built offline (cached after the first build)."""
    from onepass.render.tokenizer import load_tokenizer

    return load_tokenizer("builtin:qwen3")


def _builtin_tokenizer_folder() -> list[str]:
    """The built-in Qwen3 tokenizer's folder (built if need be): what tests/warm.py's server loads first."""
    from onepass.render.tokenizer import load_tokenizer

    return [load_tokenizer("builtin:qwen3").name_or_path]


warm.TOKENIZERS = _builtin_tokenizer_folder


@pytest.fixture(autouse=True)
def _shared_tokenizers_unchanged():
    """A test that changed a Rust tokenizer every load of its folder shares fails (tests/tokenizer_cache.py)."""
    yield
    if (line := tokenizer_cache.check()) is not None:
        pytest.fail(line)


@pytest.fixture
def with_template(qwen3_tokenizer):
    """Set the shared Qwen3 tokenizer's chat template for one test (loading a fresh one takes seconds)."""
    before = qwen3_tokenizer.chat_template

    def swap(template: str):
        qwen3_tokenizer.chat_template = template
        return qwen3_tokenizer

    yield swap
    qwen3_tokenizer.chat_template = before


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and do not crawl when other processes share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_adapter(tmp_path_factory, qwen3_tokenizer):
    """A float64 tiny Qwen3 (300 ids) saved as a base with the Qwen3 tokenizer, and a LoRA adapter on it with
    non-zero B (so merging it matters): ``(base_dir, adapter_dir, peft_model)``, for ``onepass export``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from onepass.model.tiny import tiny_model

    root = tmp_path_factory.mktemp("export")
    base_dir, adapter_dir = root / "base", root / "adapter"
    tiny_model("qwen3", 300, dtype=torch.float64, seed=0).save_pretrained(base_dir)
    qwen3_tokenizer.save_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                               init_lora_weights=False, task_type="CAUSAL_LM"))
    lora.eval()
    lora.save_pretrained(adapter_dir)
    return base_dir, adapter_dir, lora
