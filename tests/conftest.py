"""Test setup: 8 forced CPU devices, set before jax is imported anywhere."""

import os
import pathlib
import re

# The collective timeouts are raised from XLA CPU's defaults: on a loaded 2-core
# machine, 8 device threads can take longer than the default to all reach a
# rendezvous, and XLA then aborts the process instead of waiting.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  " --xla_cpu_collective_timeout_seconds=900"
  " --xla_cpu_collective_call_terminate_timeout_seconds=900"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Registers the hypothesis profiles "ci" (default) and "thorough" and loads
# the one named by $HYPOTHESIS_PROFILE.
import _hypothesis_profiles  # noqa: E402,F401
import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def pytest_configure(config):
  """With $FUZZ_REPORT=PATH, writes a per-property hypothesis table there."""
  path = os.environ.get("FUZZ_REPORT")
  if path:
    import _fuzz_report

    config.pluginmanager.register(
      _fuzz_report.FuzzReport(path), "shardopt_fuzz_report"
    )


@pytest.fixture(scope="session")
def mesh():
  """A 1-D mesh named "batch" over the 8 CPU devices."""
  assert jax.device_count() == 8, jax.devices()
  return jax.make_mesh((8,), ("batch",))


# --- Test tiers. -------------------------------------------------------------
# `make test` runs every test (CI too: .ci/run). `make test-fast` runs
# `pytest -m "not slow"`: every transform against its numpy, optax or
# TensorFlow reference, in one mapping or case each, and the argument checks,
# in under 3 minutes on 2 cores. The rest is marked slow: with
# @pytest.mark.slow in its file, or here: a whole file (SLOW_FILES) or tests
# (SLOW_TESTS: a test's name, or `name[case]` for cases of a parametrized one,
# `*` matching any text), each with the reason; KEEP names the cases of a slow
# parametrized test that stay in the fast tier.

SLOW_FILES = {
  "test_elastic.py": "processes killed and restarted",
  "test_multiprocess.py": "jax.distributed across subprocesses",
  "test_process_faults.py": "subprocesses killed mid-run",
  "test_restart.py": "subprocesses restarted from checkpoints",
  "test_notebooks.py": "notebooks",
  "test_benchmarks_smoke.py": "benchmark runs",
  "test_packaging.py": "builds the sdist and wheel",
  "test_docstrings.py": "runs every docstring example",
  "test_model_parallel_flax.py": "flax model-parallel training runs",
  "test_streaming_flax.py": "compiles a flax model; test_streaming keeps the numbers",
  "test_faults.py": "200-step fault runs; test_finite keeps the numbers",
}

_HLO = "HLO structure or copies, not numbers"
_CASES = "more cases of a reference test the fast tier keeps"
_VARIANT = "a variant; the fast tier keeps the reference test"
_LONG = "long run"
SLOW_TESTS = {
  "test_noloco.py": {
    "test_replicas_differ_and_their_spread_stays_bounded": _LONG,
  },
  "test_topk.py": {
    "test_periodic_centers_are_bit_identical_within_groups[diloco-no_groups]": (
      _CASES
    ),
  },
  "test_vmap.py": {
    "test_a_grouped_quantized_or_sparse_reduce_under_vmap_names_the_fix"
    "[comm_dtype1-the top-k wire]": (
      "more cases of a refusal test the fast tier keeps (the int8 wire)"
    ),
  },
  "test_quoted_commands.py": {
    # Each case starts a Python process (1-3 s); 17 of them.
    "test_python_m_help_lists_every_quoted_option": (
      "a subprocess per command; the fast tier keeps the elastic benchmark's"
    ),
  },
  "test_mt_dao.py": {
    "test_the_compiled_step_averages_the_params_only_in_its_branch[diloco]": (
      _HLO
    ),
  },
  "test_accumulate.py": {
    "test_mixed_precision_same_numbers_as_optax_multisteps": _CASES,
    "test_mixed_precision_cross_shard_matches_multisteps_and_stays_in_sync": (
      _CASES
    ),
    "test_growing_schedule_under_cross_shard_matches_multisteps_in_sync": (
      _VARIANT
    ),
    "test_whole_state_under_p_axis_matches_pmap": _VARIANT,
    "test_a_schedule_decides_without_a_collective": _HLO,
    "test_every_collective_of_the_update_sits_in_the_emit_branch": _HLO,
    "test_optax_multisteps_communicates_outside_any_branch": _HLO,
    "test_replicated_params_all_reduce_in_autodiff_on_every_mini_step": _HLO,
    "test_params_cast_to_varying_communicate_once_per_period": _HLO,
    "test_mini_step_copies_no_buffer_a_bare_gradient_add_does_not": _HLO,
  },
  "test_collectives.py": {
    "test_reduce_of_per_replica_values_matches_numpy": _CASES,
    "test_reduce_of_invariant_gradient_divides_instead_of_all_reducing": _CASES,
    "test_group_members_bit_identical_after_grouped_reduce": _CASES,
  },
  "test_composition.py": {
    "test_accumulate_around_powersgd_communicates_only_in_the_emit_branch": _HLO,
    "test_apply_if_finite_around_powersgd_leaves_only_the_flag_outside": _HLO,
    "test_powersgd_state_as_a_whole_under_p_axis_matches_replicated_counters": (
      _VARIANT
    ),
  },
  "test_decoupled.py": {
    "test_the_senders_mean_matches_the_authors_rule_in_numpy[shard_map]": (
      "more cases; the fast tier keeps the paper's steps in numpy"
    ),
    "test_updates_and_momentum_match_the_papers_steps_in_numpy": _CASES,
    "test_the_senders_mean_matches_the_authors_rule_in_numpy": _CASES,
    # The fast tier keeps test_the_compiled_step_gathers_the_payload_once
    # for both means.
    "test_the_senders_mean_adds_no_collective_and_no_byte": _HLO,
    "test_the_senders_mean_in_groups_and_with_one_choice_is_the_default": (
      _VARIANT
    ),
    "test_a_bfloat16_wire_keeps_its_rounding_in_the_momentum": _VARIANT,
  },
  "test_demo.py": {
    "test_demo_*": "trains the demo's four methods",
    "test_command_line_forces_cpu_devices_in_a_fresh_process": "subprocess",
    "test_python_m_examples_demo_without_the_demo_extra_prints_it_in_a_fresh_process": (
      "subprocess"
    ),
    "test_python_m_shardopt_says_where_the_demo_is": "subprocess",
  },
  "test_elastic_rounds.py": {
    "test_a_healing_round_spends_the_error_buffer_as_a_plain_round_does": (
      _VARIANT
    ),
    "test_plain_round_matches_diloco_under_shard_map": _CASES,
    "test_centers_bit_identical_across_islands": _VARIANT,
    "test_healing_round_adopts_center_and_counters": _LONG,
    "test_healing_hands_over_an_outer_adam_state_bit_for_bit": _LONG,
    "test_job_start_handshake_adopts_the_lowest_island": _LONG,
    "test_plain_rounds_on_every_wire_match_the_transforms_own_sync": _CASES,
    "test_plain_rounds_on_a_streaming_int8_wire_match_*": _VARIANT,
    "test_fragments_sync_one_fragment_per_round": _VARIANT,
  },
  "test_faults_accumulate.py": {
    "test_a_guarded_accumulate_skips_on_every_replica_and_matches_numpy": _LONG,
    "test_only_the_inner_guard_keeps_the_mini_steps_free_of_communication": _HLO,
    "test_the_accumulate_entry_of_the_kill_one_process_test_trains": _LONG,
  },
  "test_finite.py": {
    "test_nan_on_one_replica_every_replica_skips_together": "subprocesses",
    "test_dynamic_loss_scale_from_the_replicated_flag_stays_in_sync": (
      "subprocess"
    ),
    "test_the_guard_adds_only_the_4_byte_flag_to_the_inner_collectives": _HLO,
    "test_free_guard_step_has_exactly_one_all_reduce": _HLO,
    "test_a_donated_guarded_step_copies_no_more_than_the_unguarded_one": _HLO,
  },
  "test_guides.py": {
    "test_noloco_page": "a docs page; tests/test_noloco.py keeps its numbers",
    "test_coming_from_ddp": "runs the guide's code",
    "test_diloco": "runs the guide's code",
    "test_checkpointing": "runs the guide's code",
    "test_vmap_route_matches_shard_map_bit_for_bit_and_syncs_only_in_branch": (
      "runs the guide's code"
    ),
    "test_diloco_streaming_sections": "runs the guide's code",
  },
  "test_desloc.py": {
    "test_a_quantized_wire_carries_the_moments_too": _VARIANT,
  },
  "test_eager.py": {
    "test_eager_sends_what_diloco_sends[int8]": (
      "a variant; the fast tier keeps the float32 wire's HLO comparison"
    ),
  },
  "test_host_schedule.py": {
    "test_the_sync_0_program_is_the_plain_local_step[agn, float32]": _CASES,
    "test_host_schedule_matches_in_graph_under_pmap_and_vmap": (
      "a variant; the fast tier keeps the shard_map test of the same numbers"
    ),
  },
  "test_integration_flax.py": {
    "test_agn_checkpoint_mid_period_restores_and_continues_bit_identically": (
      "orbax checkpoint round trip"
    ),
    "test_tower_sharded_state_checkpoint_restores_and_continues_bit_identically": (
      "orbax checkpoint round trip"
    ),
  },
  "test_migration_doc.py": {
    "test_agn_example_syncs_once_onto_a_shared_center": (
      "runs the guide's code; the fast tier keeps its other two examples"
    ),
  },
  "test_model_parallel.py": {
    "test_host_scheduled_steps_inside_model_parallel_replicas[diloco-Explicit]": (
      _VARIANT
    ),
    "test_model_sharded_run_matches_data_only_run": _CASES,
    "test_islands_with_a_model_axis_match_the_run_without": _VARIANT,
    "test_no_collective_over_the_model_axis_beyond_plain_optax": _HLO,
    "test_tower_state_is_one_eighth_of_the_params_per_device": _HLO,
    "test_the_docs_guide_example_runs_and_replicas_agree_after_the_sync": (
      "runs the guide's code"
    ),
    "test_quantized_wire_inside_model_parallel_replicas_matches_data_only": (
      _VARIANT
    ),
    "test_host_scheduled_steps_inside_model_parallel_replicas": _CASES,
  },
  "test_outer_optimizer.py": {
    "test_the_default_spelled_as_an_optax_sgd_is_bit_identical": _VARIANT,
    "test_fragments_keep_one_outer_state_each": _VARIANT,
  },
  "test_periodic.py": {
    "test_eight_replicas_match_numpy_reference_under_pmap": _CASES,
    "test_eight_replicas_match_numpy_reference_under_shard_map": _CASES,
    "test_tf_oracle_adam_b0_one_replica_period_4": _VARIANT,
    "test_replicated_params_cast_to_varying_keep_an_invariant_center": _VARIANT,
    "test_nan_in_one_replica_is_left_out_and_the_replica_rejoins_the_center": (
      _VARIANT
    ),
    "test_no_finite_replica_leaves_center_and_global_state_unchanged": _VARIANT,
    "test_params_pulled_onto_center_are_snapped_bit_identical": _VARIANT,
    "test_state_restored_mid_period_continues_bit_identically": _LONG,
    "test_collectives_only_inside_the_sync_branch_under_*": _HLO,
    "test_agn_period_8_converges_close_to_synchronous_with_an_eighth_of_the_syncs": (
      _LONG
    ),
    "test_diloco_warm_start_matches_numpy": _VARIANT,
    "test_local_sgd_and_agn_warm_start_within_groups_match_numpy": _VARIANT,
    "test_warm_start_runs_its_all_reduce_only_in_its_branch": _HLO,
  },
  "test_powersgd.py": {
    "test_tuple_axis_names_reduce_over_both_axes": _VARIANT,
    "test_rank_at_least_min_dimension_gives_the_exact_mean": _VARIANT,
    "test_result_depends_on_p_only_through_p_p_transpose": _VARIANT,
    "test_start_step_mean_reduces_every_leaf_until_count_reaches_it": _VARIANT,
    "test_without_warm_start_each_step_starts_from_a_fresh_q": _VARIANT,
    "test_all_zero_gradient_gives_finite_updates_and_state": _VARIANT,
    "test_bfloat16_gradients_are_compressed_in_float32": _VARIANT,
    "test_compression_rule_is_strict_and_uses_the_effective_rank": _VARIANT,
    "test_hlo_bytes_per_step_equal_the_formula_under_*": _HLO,
    "test_comm_dtype_puts_the_factors_on_the_wire_in_bfloat16": _HLO,
    "test_warm_up_and_compressed_steps_sit_in_the_branches_of_one_cond": _HLO,
    "test_in_optax_chain_replicated_params_stay_replicated_and_in_sync": (
      _VARIANT
    ),
  },
  "test_properties.py": {
    "test_reduce_equals_numpy_for_random_trees_groups_and_reductions": _CASES,
    "test_grads_not_matching_the_state_structure_raise_and_change_nothing": (
      _CASES
    ),
  },
  "test_properties_transforms.py": {
    "test_accumulate_equals_optax_multisteps_for_random_k_trees_and_dtypes": (
      "random inputs; test_accumulate keeps optax's numbers"
    ),
    "test_apply_if_finite_random_nan_inf_patterns_skip_together_and_match_numpy": (
      "random inputs; test_finite keeps the numbers"
    ),
    "test_powersgd_*": "random inputs; test_powersgd keeps the numbers",
    "test_hierarchical_local_sgd_equals_numpy_for_random_schedules": (
      "random inputs; test_schedules keeps the numbers"
    ),
    "test_diloco_fragments_equal_numpy_for_random_periods_and_trees": (
      "random inputs; test_schedules keeps the numbers"
    ),
  },
  "test_quality_per_byte.py": {
    "test_the_muon_factory_orthogonalizes_only_the_kernels": (
      "two steps of the study's Muon, op by op, not compiled"
    ),
  },
  "test_quantize.py": {
    "test_quantizer_round_trip_matches_numpy_and_packs_int4_low_nibble_first": (
      _CASES
    ),
    # One compiled program per (mapping, groups) serves these three.
    "test_two_phase_reduction_matches_the_numpy_reference_bit_for_bit": _CASES,
    "test_group_members_end_bit_identical": _CASES,
    "test_error_bound_without_feedback": _CASES,
    "test_tower_quantized_reduce_scatter_matches_numpy_bit_for_bit": _CASES,
    "test_wire_carries_the_narrow_bytes_plus_scales": _HLO,
    "test_all_leaves_of_a_reduction_share_two_collectives": _HLO,
    "test_error_feedback_keeps_the_running_sum_error_bounded": _LONG,
    "test_error_feedback_state_is_per_replica_float32_in_the_leaf_shape": (
      _VARIANT
    ),
    "test_a_non_finite_step_does_not_poison_the_error_buffer": _VARIANT,
    "test_powersgd_factors_on_an_int8_wire": _VARIANT,
    "test_periodic_finite_flag_travels_in_float32": _HLO,
    "test_diloco_with_an_int4_outer_gradient_runs_and_agrees": _VARIANT,
  },
  "test_renamed.py": {
    "test_the_old_period_keyword_warns_and_gives_the_same_numbers": _VARIANT,
    "test_optimizer_keyword_is_the_old_spelling_of_inner": _VARIANT,
  },
  "test_schedules.py": {
    "test_hierarchical_one_level_of_the_axis_size_is_local_sgd_to_a_few_ulp": (
      _VARIANT
    ),
    "test_hierarchical_groups_are_contiguous_and_collectives_stay_in_them": _HLO,
    "test_streaming_diloco_matches_numpy_reference": _CASES,
    "test_one_fragment_is_diloco_bit_for_bit": _VARIANT,
    "test_each_fragment_sync_all_reduces_only_its_fragment": _HLO,
    "test_checkpoint_mid_period_restores_bit_identically": _LONG,
    "test_islands_match_numpy_reference_under_shard_map": _CASES,
    "test_whole_state_under_p_axis_with_stacked_counters_matches_pmap": (
      _VARIANT
    ),
    "test_p_unit_counters_still_work_under_shard_map": _VARIANT,
    "test_a_non_sync_step_copies_nothing_once_its_state_is_donated": _HLO,
    "test_a_sync_cond_returns_only_what_the_sync_changes": _HLO,
  },
  "test_streaming.py": {
    "test_reference_with_tau_0_alpha_0_is_todays_streaming_diloco": _VARIANT,
    "test_overlap_matches_numpy_reference": _CASES,
    "test_overlap_matches_numpy_reference_under_shard_map": _VARIANT,
    "test_tau_0_alpha_0_is_streaming_diloco_bit_for_bit": _VARIANT,
    "test_layer_fragments_match_numpy_reference": _CASES,
    "test_layer_fragments_along_axis_1_match_numpy_reference": _VARIANT,
    "test_layer_fragments_peak_bytes_per_sync": _HLO,
    "test_outer_gradient_error_feedback_keeps_the_center_on_course": _LONG,
    "test_quantized_streaming_with_overlap_and_layers_under_shard_map": _VARIANT,
  },
  "test_pier.py": {
    "test_pier_is_the_authors_loop_over_40_syncs[pmap]": _VARIANT,
  },
  "test_study_replicas.py": {
    "test_digits_under_vmap_matches_pmap": (
      "trains the study's model two ways per method (a benchmark's harness,"
      " not a transform: all slow)"
    ),
  },
  "test_traffic.py": {
    "test_docs_bytes_page_prints_what_it_shows_and_the_readme_numbers": (
      "runs the guide's code; test_bytes_page keeps the page's facts"
    ),
  },
  "test_tower.py": {
    "test_tower_equals_cross_shard_under_pmap": _CASES,
    "test_tower_equals_cross_shard_under_shard_map": _CASES,
    "test_tower_over_a_tuple_of_axes_and_mixed_varying_leaves_equals_cross_shard": (
      _VARIANT
    ),
    "test_adam_state_bytes_per_replica_are_ceil_size_over_n": _HLO,
    "test_compiled_step_reduce_scatters_and_all_gathers_without_all_reduce": _HLO,
    "test_compiled_step_copies_no_more_than_plain_optax": _HLO,
    "test_sharding_aware_clip_inside_tower_equals_optax_clip_of_full_gradient_pmap": (
      _VARIANT
    ),
  },
}

KEEP = {
  "test_quoted_commands.py": [
    "test_python_m_help_lists_every_quoted_option[benchmarks.perf.elastic]",
  ],
  "test_collectives.py": [
    "test_reduce_of_per_replica_values_matches_numpy[pmap-no_groups-*]",
    "test_reduce_of_per_replica_values_matches_numpy[shard_map_check_vma-pairs-*]",
    "test_reduce_of_invariant_gradient_divides_instead_of_all_reducing[mean-no_comm_dtype]",
    "test_group_members_bit_identical_after_grouped_reduce[shard_map_check_vma-pairs]",
  ],
  "test_decoupled.py": [
    "test_updates_and_momentum_match_the_papers_steps_in_numpy[shard_map]",
  ],
  "test_elastic_rounds.py": [
    "test_plain_round_matches_diloco_under_shard_map[diloco]",
  ],
  "test_model_parallel.py": [
    "test_model_sharded_run_matches_data_only_run[chain(cross_shard_sum)-Explicit]",
  ],
  "test_periodic.py": [
    "test_eight_replicas_match_numpy_reference_under_pmap[3-mean-groups]",
    "test_eight_replicas_match_numpy_reference_under_pmap[4-sum-all]",
    "test_eight_replicas_match_numpy_reference_under_shard_map[mean-groups]",
  ],
  "test_properties.py": [
    "test_reduce_equals_numpy_for_random_trees_groups_and_reductions[pmap-mean]",
    "test_reduce_equals_numpy_for_random_trees_groups_and_reductions[shard_map-sum]",
  ],
  "test_quantize.py": [
    # float8_e5m2 takes float8_e4m3fn's code path with another dtype: slow.
    "test_two_phase_reduction_matches_the_numpy_reference_bit_for_bit[int8-pmap-pairs]",
    "test_two_phase_reduction_matches_the_numpy_reference_bit_for_bit[float8_e4m3fn-pmap-pairs]",
    "test_two_phase_reduction_matches_the_numpy_reference_bit_for_bit[int4-pmap-pairs]",
    "test_group_members_end_bit_identical[pmap-pairs]",
    "test_error_bound_without_feedback[int8-pairs]",
    "test_error_bound_without_feedback[float8_e4m3fn-pairs]",
    "test_error_bound_without_feedback[int4-pairs]",
    "test_tower_quantized_reduce_scatter_matches_numpy_bit_for_bit[int8]",
  ],
  "test_schedules.py": [
    "test_streaming_diloco_matches_numpy_reference[2-*]",
    "test_islands_match_numpy_reference_under_shard_map[diloco-P(island)]",
  ],
  "test_streaming.py": [
    "test_overlap_matches_numpy_reference[2-1-0.5]",
    "test_overlap_matches_numpy_reference[4-3-0.0]",
    "test_layer_fragments_match_numpy_reference[2-tau2]",
  ],
  "test_tower.py": [
    "test_tower_equals_cross_shard_under_pmap[adam]",
    "test_tower_equals_cross_shard_under_shard_map[sgd]",
  ],
}


def _matches(pattern, item):
  """``name`` matches every case of a test, ``name[case]`` the cases whose
  id matches; ``*`` matches any text."""
  name = item.name if "[" in pattern else getattr(item, "originalname", "")
  regex = re.escape(pattern).replace(r"\*", ".*")
  return re.fullmatch(regex, name or item.name) is not None


def _stale(path, patterns):
  """The patterns whose test ``path`` does not define (renamed or gone)."""
  text = path.read_text()
  stale = []
  for name in sorted({p.split("[")[0] for p in patterns}):
    defined = re.escape(name).replace(r"\*", r"\w*")
    if not re.search(r"^def " + defined + r"\(", text, re.MULTILINE):
      stale.append(name)
  return stale


# The fast tier's size (the tests not marked slow), stashed on the config when
# a run collected every tests/test_*.py: tests/test_fast_tier.py compares it
# with the count tests/fast_tier.json recorded, without collecting again.
FAST_TIER_COUNT = pytest.StashKey[int]()


# The longest tests (minutes each in CI), run first: with ``-n 2`` each
# worker starts on one while the rest of the suite balances around them,
# instead of one starting near the end and leaving the other worker idle.
FIRST = (
  "test_tiny_run_writes_every_section",
  "test_lm_under_vmap_matches_pmap_and_its_bytes_match_the_chunks_hlo",
  "test_quick_run_writes_every_section",
  "test_a_chaos_run_of_20_kills_loses_no_contribution",
  "test_a_chaos_run_of_20_kills_loses_no_contribution_and_stalls_no_one",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Marks SLOW_FILES and SLOW_TESTS (less KEEP) slow, before ``-m`` selects;
  a name here that its file no longer defines is an error. Puts the FIRST
  tests first, longest first."""
  first = {name: k for k, name in enumerate(FIRST)}
  items.sort(key=lambda item: first.get(item.originalname, len(first)))
  files = {}
  for item in items:
    file = item.path.name
    files.setdefault(file, item.path)
    slow = SLOW_TESTS.get(file, {})
    if file in SLOW_FILES or (
      any(_matches(p, item) for p in slow)
      and not any(_matches(p, item) for p in KEEP.get(file, []))
    ):
      item.add_marker(pytest.mark.slow)
  stale = {
    file: names
    for file, path in files.items()
    if (names := _stale(path, [*SLOW_TESTS.get(file, {}), *KEEP.get(file, [])]))
  }
  if stale:
    raise pytest.UsageError(
      f"tests/conftest.py (SLOW_TESTS, KEEP) names tests their files do not"
      f" define: {stale}; rename or remove those entries"
    )
  here = pathlib.Path(__file__).resolve().parent
  if {p.resolve() for p in files.values()} == set(here.glob("test_*.py")):
    config.stash[FAST_TIER_COUNT] = sum(
      1 for item in items if item.get_closest_marker("slow") is None
    )
