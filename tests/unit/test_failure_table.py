"""Every row of the README's "Failure handling" table is a named test: ``ROWS`` binds each row (its first
cell) to the tests that do what it says, with the defaults, on real parts. A row added without tests, a
row renamed, or a named test renamed or deleted fails here, so a promise cannot be broken, or made, without
a red suite."""

from __future__ import annotations

import ast
import os
import re

import pytest

from tests.conftest import REPO

ROWS: dict[str, list[str]] = {
    "a worker dies, or user code raises": [
        "tests/ray/test_smoke.py::test_a_rank_killed_from_outside_recovers_from_its_peer_bitwise",
        "tests/ray/test_faults.py::test_killed_worker_recovers_bitwise_equal",
        "tests/ray/test_never_worse.py::test_the_same_rank_killed_three_times_on_one_node_recovers_from_peers_each_time_bitwise",
        "tests/ray/test_faults.py::test_user_exception_once_is_retried",
        "tests/ray/test_faults.py::test_same_exception_same_step_twice_fails_fast",
    ],
    "a node is lost": [
        "tests/cluster/test_node_failure.py::test_a_node_with_4_of_8_ranks_lost_is_one_incident_recovered_from_peers_exactly",
        "tests/cluster/test_node_failure.py::test_without_spare_continues_at_min_workers_then_grows_back",
        "tests/cluster/test_multihost.py::test_job_across_hosts_survives_a_lost_node",
    ],
    "a drain notice (spot preemption)": [
        "tests/cluster/test_preemption.py::test_preemption_notice_moves_a_rank_before_the_deadline_with_no_step_lost",
    ],
    "a hang": [
        "tests/ray/test_hang_peers.py::test_a_hung_rank_is_replaced_and_the_three_others_keep_their_processes",
        "tests/ray/test_faults.py::test_hang_is_detected_by_heartbeat_and_recovered",
    ],
    "a NaN or infinite loss": [
        "tests/ray/test_faults.py::test_a_diverged_run_stops_at_once_naming_the_step_and_keeps_its_good_checkpoints",
        "tests/ray/test_rollback.py::test_a_nan_loss_rolls_back_past_its_batches_exactly_as_skipping_them_by_hand",
    ],
    "replicas disagree (silent data corruption)": [
        "tests/ray/test_replica.py::test_a_flipped_bit_is_found_rolled_back_and_the_run_ends_bitwise_equal",
    ],
    "a slow rank, a node that keeps failing": [
        "tests/ray/test_faults.py::test_a_slow_rank_is_named_with_its_host_and_cleared_never_on_the_others",
        "tests/cluster/test_preemption.py::test_a_slow_rank_is_moved_to_another_node_between_two_steps",
        "tests/cluster/test_quarantine.py::test_two_deaths_on_one_node_keep_it_out_for_the_run_and_its_resubmission",
        "tests/ray/test_never_worse.py::test_random_ranks_killed_ten_times_at_four_ranks_on_one_node_finish_bitwise",
    ],
    "storage errors": [
        "tests/cluster/test_storage_outage.py::test_job_finishes_through_a_storage_outage",
        "tests/multiprocess/test_store_faults_s3.py::test_every_injection_point_keeps_what_verified_on_s3",
    ],
    "you stop it (Ctrl-C, `ray job stop`, `python -m cluster stop`)": [
        "tests/ray/test_control.py::test_stopped_by_the_cli_then_by_ctrl_c_then_resumed_ends_bitwise_as_an_uninterrupted_run",
        "tests/cluster/test_job_submit.py::test_job_stop_stops_at_a_step_with_a_checkpoint_there_and_shuts_workers_down",
        "tests/ray/test_smoke.py::test_a_stopped_run_resubmitted_resumes_from_its_stop_and_ends_bitwise",
    ],
    "the driver dies": [
        "tests/ray/test_driver_kill_rows.py::test_a_killed_driver_s_rows_are_on_storage_and_the_resubmission_completes_them",
        "tests/ray/test_lease_jobs.py::test_a_second_job_is_refused_and_a_paused_one_is_taken_over_and_fenced",
        "tests/cluster/test_driver_failover.py::test_a_killed_driver_s_ranks_are_adopted_by_the_next_submission",
        "tests/cluster/test_driver_failover.py::test_ranks_no_driver_comes_back_for_stop_within_the_orphan_timeout",
    ],
    "a bad config or storage URL": [
        "tests/unit/test_mistakes.py::test_a_mistake_is_refused_up_front_in_one_line",
        "tests/ray/test_cli.py::test_job_with_a_bad_storage_url_exits_2_before_ray",
        "tests/cluster/test_job_submit.py::test_bad_config_fails_the_job_with_the_field_named",
    ],
}


GUARDS: dict[str, list[str]] = {
    # Each guard or policy, and its tests on ONE node (a local Ray) with the defaults where it fires: the run
    # finishes and ends no worse than without the guard (not failed, no more steps recomputed, the state
    # from memory rather than storage). Bound here so that a guard cannot lose its test unnoticed.
    "quarantine (lemon nodes)": [
        "tests/ray/test_never_worse.py::test_the_same_rank_killed_three_times_on_one_node_recovers_from_peers_each_time_bitwise",
        "tests/ray/test_never_worse.py::test_random_ranks_killed_ten_times_at_four_ranks_on_one_node_finish_bitwise",
        "tests/unit/test_quarantine.py::test_a_node_the_run_cannot_be_placed_without_is_never_quarantined_and_the_run_finishes",
    ],
    "replica guard": [
        "tests/ray/test_replica.py::test_a_flipped_bit_is_found_rolled_back_and_the_run_ends_bitwise_equal",
    ],
    "hang suspects": [
        "tests/ray/test_hang_peers.py::test_a_hung_rank_is_replaced_and_the_three_others_keep_their_processes",
    ],
    "slow-rank moves": [
        "tests/ray/test_never_worse.py::test_a_slow_rank_told_to_move_on_one_node_stays_and_the_run_ends_as_without_the_guard",
        "tests/unit/test_driver_moves.py::test_a_slow_rank_with_nowhere_to_go_stays_and_is_only_reported",
    ],
    "preemption moves": [
        "tests/unit/test_driver_moves.py::test_no_room_and_min_workers_rule_out_shrinking_so_the_same_ranks_go_on",
        "tests/cluster/test_preemption.py::test_a_notice_on_the_only_node_changes_nothing_a_run_without_the_guard_would_not_have",
    ],
    "NaN rollback": [
        "tests/ray/test_rollback.py::test_a_nan_loss_rolls_back_past_its_batches_exactly_as_skipping_them_by_hand",
    ],
    "hot spare": [
        "tests/ray/test_faults.py::test_hot_spare_replaces_a_killed_worker",
        "tests/ray/test_faults.py::test_a_hot_spare_still_preparing_takes_the_dead_rank_s_place",
    ],
    "lease": [
        "tests/ray/test_driver_kill_rows.py::test_a_killed_driver_s_rows_are_on_storage_and_the_resubmission_completes_them",
        "tests/ray/test_driver_kill_cleanup.py::test_a_killed_driver_leaves_no_process_of_its_ray_and_the_run_is_interrupted_at_once",
    ],
}


def readme_rows() -> list[str]:
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    section = text.split("## Failure handling", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [re.split(r"(?<!\\)\|", row)[1].strip() for row in rows[1:]]  # the header row is not a promise


def test_every_row_of_the_readme_failure_table_names_its_tests() -> None:
    rows = readme_rows()
    assert len(rows) >= 10
    assert sorted(rows) == sorted(ROWS), (
        f"rows without tests: {sorted(set(rows) - set(ROWS))}; bound rows the README no longer has: "
        f"{sorted(set(ROWS) - set(rows))}"
    )


@pytest.mark.parametrize("node", sorted({n for ids in [*ROWS.values(), *GUARDS.values()] for n in ids}))
def test_each_named_test_exists(node: str) -> None:
    path, name = node.split("::")
    tree = ast.parse(open(os.path.join(REPO, path), encoding="utf-8").read())
    names = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    assert name in names, f"{node}: no such test (renamed or deleted? bind the README row to its new name)"
