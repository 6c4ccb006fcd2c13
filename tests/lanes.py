"""Test lanes: the ``server``, ``process`` and ``slow`` marks, and a check that they are right.

``tests/conftest.py`` calls :func:`mark` on the collected tests:

- ``server``: the test uses a loopback server or emulator (a fixture of ``tests/servers.py`` or
  ``tests/emulators.py`` or one in :data:`SERVER_FIXTURES`, directly or through another fixture;
  a parameter in :data:`SERVER_PARAMS`; a test in :data:`SERVER_TESTS`).
- ``process``: the test starts processes (DataLoader workers, a conversion with ``workers > 1``,
  ``multiprocessing``, ``subprocess``, ``torch.distributed``): every test of a module in
  :data:`PROCESS_MODULES`, a test named in :data:`PROCESS_TESTS`, a test that uses a fixture in
  :data:`PROCESS_FIXTURES`.
- ``slow``: besides the tests marked in their module, those of :data:`SLOW_MODULES` and
  :data:`SLOW_TESTS`, moved out of the quick lane.

The quick lane is ``python -m pytest -q -m "not process and not server and not slow"``
(docs/testing.md). With ``SHARDFLOW_CHECK_MARKS=1`` in the environment, a test that starts a
process without the ``process`` mark, or listens on an inet socket (a server) without the
``server`` mark, is named at the end of the run, and the run fails: run the quick lane that way
after adding tests.
"""

from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

ENV = "SHARDFLOW_CHECK_MARKS"

# Fixtures that start a loopback server, or an emulator, for the tests that use them (directly or
# through another fixture): those of tests/servers.py and tests/emulators.py, and a few of one
# module (test_differential's http_root, test_hygiene's http_url, test_hostile_http's servers,
# test_hostile_manifest's endless_server).
SERVER_FIXTURES = frozenset(
    """
    http_server flaky_http_server moto_server s3_prefix s3_options s3_proxy
    gcs_server azurite gcs_prefix az_prefix gcs_proxy az_proxy
    http_root http_url servers endless_server
    """.split()
)

# Parameters that pick a server through ``request.getfixturevalue``, which the fixture closure
# cannot see: ``store`` (test_storage), ``cloud`` (test_clouds), ``where`` (test_differential).
SERVER_PARAMS = {"store": {"http", "s3"}, "cloud": {"gs", "az"}, "where": {"http", "s3"}}

# Tests that start a server of their own in their body.
SERVER_TESTS = {"test_storage": "test_open_output_upload_failure_is_remote_write_error"}

# Modules whose every test starts processes.
PROCESS_MODULES = frozenset(
    """
    test_convert_dask test_convert_kills test_crash_consistency test_ddp test_reproducible_training
    """.split()
)

# Module-scoped fixtures that start processes (a conversion with workers > 1): test_mixed_images's
# converted, test_collation's fake_hetero, test_convert_imagefolder's big_converted. Every test
# that uses one is a process test, though only the first to run starts them.
PROCESS_FIXTURES = frozenset({"converted", "fake_hetero", "big_converted"})

# Tests that start processes, by module: every parametrization of each function named. Found by
# running the quick lane with SHARDFLOW_CHECK_MARKS=1 (a process started, or an inet socket
# listened on, during the test's setup, call or teardown).
PROCESS_TESTS = {
    "test_bad_input": """
        test_a_pass_that_yields_nothing_fails test_bad_shards_through_loader_workers
        test_through_loader_workers_error_names_shard_key_and_reason
        test_through_loader_workers_stats_are_added_up
    """,
    "test_batching": """
        test_collate_stacks_into_shared_memory_in_workers
        test_loader_worker_error_in_the_first_batch_reaches_the_main_process
        test_loader_workers_prime_their_first_batch
    """,
    "test_breaker": """
        test_parquet_classlabel_minus_one_is_kept test_parquet_classlabel_out_of_range_is_an_error
    """,
    "test_cli_bench": """
        test_bench_skips_and_counts_corrupt_samples
        test_bench_works_by_default_on_a_converted_folder test_text_summary_with_workers_and_shuffle
    """,
    "test_cli_inspect": """
        test_help_and_inspect_of_image_shards_do_not_import_torch
        test_keys_option_and_process_pool_agree test_without_manifest_scans_shards
    """,
    "test_cli_verify": "test_json_report_and_workers_agree test_progress_reaches_the_callback",
    "test_clouds": """
        test_imagefolder_converter_writes_to_the_bucket test_resume_mid_epoch_through_workers
        test_write_then_read_by_folder_glob_and_pattern
    """,
    "test_codecs": "test_a_graph_dataset_imports_its_codec_in_the_parent",
    "test_collation": """
        test_golden_fake_hetero_dataset test_golden_shuffled_with_workers_and_exclude_keys
        test_graphs_that_differ_raise_naming_the_samples test_migration_recipe_in_memory_dataset
    """,
    "test_config": """
        test_config_and_loader_class_are_reachable_after_import_shardflow
        test_transforms_are_reachable_after_a_plain_import_shardflow
    """,
    "test_convert_arrays": """
        test_cli test_hdf5_matrices_exact_and_cropped test_npy_rows_round_trip_stream_and_indexed
        test_npz_members_and_labels_by_name
    """,
    "test_convert_engine": "test_a_failed_conversion_leaves_no_staged_shard",
    "test_convert_imagecheck": "test_corrupt_images_are_skipped_and_named",
    "test_convert_imagefolder": """
        test_c08_writer_killed_mid_shard test_c14_allow_empty test_c14_cli test_extensions_option
        test_webdataset_reads_the_shards
    """,
    "test_convert_lines": """
        test_gzip_text_lines_exact test_jsonl_100k_lines_exact_in_window_order
        test_malformed_json_names_the_line
    """,
    "test_convert_lmdb": """
        test_fifty_jpeg_values_keys_preserved_bytes_unchanged
        test_key_ranges_in_parallel_with_escaped_keys
    """,
    "test_convert_parquet": """
        test_hugging_face_layout_converts_with_defaults
        test_shards_span_row_groups_and_files_in_parallel
    """,
    "test_convert_pyg": """
        test_cli_convert_pyg_end_to_end test_cli_help_lists_pyg test_fake_dataset_spec_with_kwargs
        test_forked_workers_after_torch_threads_do_not_hang
        test_in_memory_dataset_root_bytes_proportional test_on_disk_dataset_root
    """,
    "test_convert_record_orders": "test_a_killed_shuffled_conversion_resumes_byte_identical",
    "test_convert_remote": "test_cli_refuses_another_dataset_and_reports_kept_shards test_memory_tree",
    "test_convert_write": """
        test_a_build_function_that_does_not_pickle_is_an_error_with_workers
        test_bytes_do_not_depend_on_workers test_crash_mid_run_resumes
    """,
    "test_cost_batching": """
        test_node_and_edge_budgets_at_once test_node_budget_equal_batches_every_sample_once
    """,
    "test_dataloader": "test_dataloader_keywords_pass_through_to_torch test_worker_count_warning_once",
    "test_dataset": """
        test_a_bad_shard_read_by_two_workers_counts_once
        test_skip_keeps_the_planned_number_of_batches
    """,
    "test_differential": "test_loader test_resume",
    "test_elastic": """
        test_elastic_twice_in_one_epoch test_resume_on_the_same_world_from_the_other_ranks_state
        test_shuffled_batch_sequence_is_the_same_for_any_worker_count
        test_stop_two_ranks_resume_on_another_world
    """,
    "test_expand": "test_loader_resumes_mid_epoch_with_crops test_one_crop_per_sample_is_still_applied",
    "test_frames": """
        test_resume_exact_and_equal_to_the_plain_epoch test_same_shuffled_epoch_as_the_plain_shards
        test_zstd_dc_pipe_tar_lists_the_members
    """,
    "test_plan_cost": "test_shard_affinity_resumes_exactly",
    "test_report": """
        test_a_slow_transform_is_the_slowest_stage_and_the_loop_input_bound test_accounting_off_times_no_stage
    """,
    "test_trace": "test_the_trace_holds_each_workers_stages_and_the_loops_waits",
    "test_hostile_faults": "test_a_killed_runs_lock_goes_with_it_though_a_forked_worker_lives_on",
    "test_hostile_surface": """
        test_a_parquet_image_path_out_of_the_images_root_is_refused
        test_a_quiet_test_run_names_the_missing_azure_emulator_and_its_install
        test_convert_prints_hostile_file_names_escaped
        test_inspect_of_graphs_without_torch_geometric_names_the_extra
        test_stateful_dataloader_with_workers_warns_at_save_and_refuses_the_resume
        test_warnings_print_above_the_progress_bar_not_inside_it
    """,
    "test_frameworks": """
        test_lightning_data_module_epochs_are_shardflow_epochs
        test_lightning_resumes_a_mid_epoch_checkpoint_exactly
        test_stateful_dataloader_with_workers_refuses_to_resume_use_shardflow_loader
    """,
    "test_graph_codec": "test_lazy_imports_and_rule_classes_by_name_in_a_fresh_interpreter",
    "test_graph_collate": "test_batches_of_decoded_subclass_graphs_unpickle_in_a_fresh_interpreter",
    "test_hostile": """
        test_big_member_is_held_once test_decompression_bomb_raise_is_fast_and_small
        test_decompression_bomb_skip_streams_past_it
        test_graph_limits_are_options_and_bound_collate_memory
        test_manifest_declaring_more_samples_than_the_shard_holds_fails_fast
        test_one_writer_per_destination_and_a_crashed_one_holds_nothing
        test_workers_exit_when_the_main_process_is_killed
    """,
    "test_hostile_decode": "test_a_compressed_field_bomb_is_refused_within_the_limits",
    "test_hostile_graph": "test_a_huge_sparse_size_is_a_decode_error",
    "test_hostile_keys": "test_long_distinct_keys_do_not_accumulate",
    "test_hostile_manifest": "test_an_endless_remote_manifest_stops_at_the_cap",
    "test_hygiene": """
        test_resources_come_back test_spawn_workers test_unpicklable_transform_with_spawn_says_so
    """,
    "test_indexed": """
        test_distributed_sampler_with_workers_covers_every_index
        test_spawned_workers_get_a_pickled_copy
    """,
    "test_interop": "test_shardflow_reads_tar_of_a_sorted_folder",
    "test_mixed_images": """
        test_bench_reads_the_mixed_folder test_graphs_config_runs_on_pyg_converter_shards
        test_images_config_runs_on_the_converted_folder
        test_readme_image_snippet_runs_on_the_mixed_folder
        test_the_converter_records_the_image_fields
    """,
    "test_phases": """
        test_a_fresh_start_on_compressed_shards_with_an_index_streams_them_whole
        test_resume_through_the_first_phase_is_exact
        test_resume_through_the_first_phase_with_a_truncated_shard
        test_shards_without_an_index_are_read_in_one_phase_and_resume
    """,
    "test_remote": "test_main_process_reads_after_workers_were_forked",
    "test_resume": """
        test_a_second_iter_before_the_first_ends test_c11_break_without_saving_starts_a_new_epoch
        test_c11_changed_worker_count_resumes_the_remaining_batches
        test_c11_changed_world_size_resumes_exactly test_c11_resume_after_five_batches
        test_c11_resume_at_any_step test_c11_resume_in_a_later_epoch
        test_c11_resume_other_worker_counts test_c11_resume_persistent_workers
        test_c11_resume_with_ranks test_resume_every_step_with_uneven_worker_runs
        test_resume_twice_in_one_epoch test_set_epoch_between_iter_and_first_batch_names_the_state
        test_state_before_and_after_an_epoch test_state_right_after_loading_keeps_the_position
        test_unsized_changed_worker_count_raises test_unsized_loader_resumes_with_the_same_workers
    """,
    "test_seeding": """
        test_a_resumed_epoch_draws_what_the_uninterrupted_one_did
        test_collate_draws_follow_rank_and_batch_index test_every_sample_draws_what_its_seed_gives
        test_sample_rng_and_generator_follow_the_sample test_seeding_only_the_named_generators
        test_unsized_collate_draws_are_seeded_by_the_batchs_position
        test_zero_and_two_workers_and_a_rerun_draw_the_same
    """,
    "test_selection": "test_select_with_workers_equals_in_process_and_resumes",
    "test_sources": "test_resume_mid_epoch_in_a_mixture",
    "test_split": """
        test_a_dataset_given_to_a_loader_still_iterates_samples test_c01_dataset_without_loader
        test_c01_one_shard_two_ranks test_c01_without_manifest_a_rank_without_data_raises
        test_c01_worker_with_no_data_ends_cleanly test_c02_equal_batch_counts_for_any_split
        test_c02_remainder_policy_pad_and_drop test_c02_uneven_shards_equal_batches
        test_c03_every_key_once_over_all_streams test_c03_ten_items_four_workers_no_ranks
        test_c04_counts_do_not_depend_on_num_workers test_c04_len_matches_a_pass_with_a_remainder
        test_c04_unsized_stream_has_no_len test_c05_epochs_agree_after_iterating_in_this_process
        test_c05_epochs_are_partitions_and_reproducible
        test_c05_new_iter_without_set_epoch_starts_the_next_epoch test_c05_plain_dataloader_epochs
        test_shuffled_batches_mix_shards
    """,
    "test_storage": "test_local_conversion_imports_neither_fsspec_asyncio_nor_http",
    "test_tar": "test_writer_bytes_read_by_tarfile_and_gnu_tar",
    "test_transfer": """
        test_a_collate_fn_keeping_the_last_batch_in_the_worker_sees_it_intact
        test_a_collate_fn_returning_views_of_the_batch_keeps_every_batch_intact
        test_a_plain_dataloader_gets_every_batch_intact
        test_loader_batches_through_the_pool_are_exact_and_unmapped_after
    """,
    "test_transforms": "test_a_per_field_transform_gives_one_batch_tensor",
    "test_warmstart": "test_a_forked_child_does_not_keep_this_processes_claims",
    "test_writer": "test_bytes_only_writer_does_not_import_torch",
    "test_writer_folder": """
        test_conversion_replays_a_crashed_writer_journal_first
        test_same_series_after_a_killed_writer_is_a_rerun
        test_writer_after_a_killed_writer_keeps_its_shards
    """,
    "test_image_sizes": """
        test_cli_max_side test_convert_max_side_shrinks_big_images_keeps_small_ones
        test_convert_without_max_side_is_unchanged_and_a_changed_setting_rewrites test_dataset_min_side
    """,
    "test_cli_startup": """
        test_a_command_imports_only_its_own_module
        test_help_imports_neither_torch_numpy_fsspec_nor_a_command_module
    """,
    "test_world": "test_persistent_workers_started_from_a_thread_that_ends_keep_serving",
}

# Tests moved out of the quick lane (marked slow): the slowest of it by ``--durations``, each
# seconds of CPU where a unit test takes milliseconds. The differential suite and the big-field
# checks (MiB-sized fields on every read path), whole; property-based round trips; a test whose
# module fixture builds decompression bombs.
SLOW_MODULES = frozenset({"test_differential", "test_big_fields"})
SLOW_TESTS = {
    "test_fuzz_shards": "test_every_reader_yields_originals_or_raises",
    "test_graph_codec": "test_random_graphs_round_trip_exactly",
    "test_graph_collate": "test_random_collections_equal_pyg",
    "test_graph_records": "test_random_collections_equal_pyg",
    "test_hostile": "test_the_member_limit_is_an_io_option",
}


def _names(table: dict[str, str], module: str) -> set[str]:
    return set(table.get(module, "").split())


def mark(items: list[pytest.Item]) -> None:
    """Add the ``server``, ``process`` and ``slow`` marks to the collected ``items``."""
    for item in items:
        module = item.path.stem
        name = getattr(item, "originalname", item.name)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (
            SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))
            or any(params.get(arg) in values for arg, values in SERVER_PARAMS.items())
            or name in _names(SERVER_TESTS, module)
        ):
            item.add_marker(pytest.mark.server)
        if (
            module in PROCESS_MODULES
            or name in _names(PROCESS_TESTS, module)
            or PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))
        ):
            item.add_marker(pytest.mark.process)
        if module in SLOW_MODULES or name in _names(SLOW_TESTS, module):
            item.add_marker(pytest.mark.slow)


def _not_a_library_probe(*_: Any) -> bool:
    """False for ``ctypes.util.find_library``'s ``ldconfig -p``, which a first import may run."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("ctypes", "util.py")):
            return False
        frame = frame.f_back
    return True


class Watch:
    """Records, per test, the processes it starts and the sockets it listens on."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.unmarked: dict[str, list[str]] = {}

    def install(self) -> None:
        """Wrap the calls that start a process or a server (for this test session)."""
        self._wrap(os, "fork", "os.fork")
        self._wrap(subprocess.Popen, "__init__", "subprocess.Popen", _not_a_library_probe)
        self._wrap(multiprocessing.process.BaseProcess, "start", "multiprocessing start")
        self._wrap(socket.socket, "listen", "socket listen", lambda sock, *_: sock.family != socket.AF_UNIX)

    def _wrap(self, owner: Any, attr: str, what: str, counts: Callable[..., bool] = lambda *_: True) -> None:
        original: Callable[..., Any] = getattr(owner, attr)
        seen = self.seen

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if counts(*args):
                seen.append(what)
            return original(*args, **kwargs)

        setattr(owner, attr, wrapped)

    def check(self, item: pytest.Item) -> None:
        """Note ``item`` if it started a process without the ``process`` mark, or listened on an
        inet socket without the ``server`` mark."""
        seen, self.seen[:] = set(self.seen), []
        missing = [
            what
            for what in sorted(seen)
            if not item.get_closest_marker("server" if what == "socket listen" else "process")
        ]
        if missing:
            self.unmarked[item.nodeid] = missing


WATCH = Watch() if os.environ.get(ENV, "") not in ("", "0") else None
if WATCH is not None:
    WATCH.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Check each test's starts when ``SHARDFLOW_CHECK_MARKS`` is set."""
    if WATCH is not None:
        WATCH.seen[:] = []
    yield
    if WATCH is not None:
        WATCH.check(item)


def summary(terminalreporter: Any) -> None:
    """Name the tests that started a process or a server without its mark (from the conftest's
    ``pytest_terminal_summary``)."""
    if WATCH is None:
        return
    terminalreporter.section(f"{ENV}: unmarked tests that started a process or a server")
    for nodeid, seen in WATCH.unmarked.items():
        terminalreporter.line(f"{nodeid}: {', '.join(seen)}")
    terminalreporter.line(f"{len(WATCH.unmarked)} unmarked")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when an unmarked test started a process or a server."""
    if WATCH is not None and WATCH.unmarked and exitstatus == 0:
        session.exitstatus = 1
