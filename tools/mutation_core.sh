#!/usr/bin/env bash
# Mutation-test the numeric and safety core, module by module (`make mutation-core`).
# Each line: a module and the tests that guard it (mutmut runs, per mutant, only those of
# them that reach the mutated function). Scores and equivalent mutants: docs/mutation.md.
# MODULES="a.py b.py" picks some; a second run resumes each module where it stopped.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export HYBRIDREC_DIFF_CASES=${HYBRIDREC_DIFF_CASES:-60}  # the TorchRec differential test, per mutant
declare -A TESTS=(
  [sparse_jax/_validate.py]="tests/test_input_checks.py tests/test_jagged.py tests/test_embedding_bag.py"
  [sparse_jax/planner/_constraints.py]="tests/test_planner_constraints.py tests/test_planner.py"
  [sparse_jax/_update.py]="tests/test_update_contract.py tests/test_kernel_update.py tests/test_optim.py tests/test_padding_segments.py tests/test_nonfinite.py"
  [sparse_jax/optim/*]="tests/test_optim.py tests/test_kernel_update.py tests/test_padding_segments.py tests/test_update_contract.py tests/test_rounding.py"
  [sparse_jax/_lookup.py]="tests/test_kernel_update.py tests/test_lookup_paths.py tests/test_padding_segments.py tests/test_embedding_bag.py tests/test_input_checks.py"
  [sparse_jax/sharding/_row_stat.py]="tests/test_sharding.py::test_every_local_row_finds_its_tables_row_statistic tests/test_sharding.py::test_sharded_rowwise_adagrad_matches_loops_not_only_the_unsharded_code[mixed-FP32] tests/test_sharding.py::test_sharded_rowwise_adagrad_matches_loops_not_only_the_unsharded_code[mixed_2-FP16] tests/test_collective_bytes.py"
  [sparse_jax/sharding/_local_batch.py]="tests/test_local_batch.py tests/test_route_need.py tests/test_sharding.py"
  [hybrid/model/_bridge.py]="tests/test_bridge_contract.py tests/test_hybrid_bridge.py"
  [sparse_jax/_jagged.py]="tests/test_jagged_api.py tests/test_jagged.py tests/test_torchrec_differential.py tests/test_input_checks.py"
  [hybrid/checkpoint/*]="tests/test_checkpoint.py tests/test_checkpoint_faults.py tests/test_managed_checkpoint.py"
)
ORDER=(sparse_jax/_validate.py sparse_jax/planner/_constraints.py sparse_jax/_update.py "sparse_jax/optim/*"
       sparse_jax/_lookup.py sparse_jax/sharding/_row_stat.py sparse_jax/sharding/_local_batch.py
       hybrid/model/_bridge.py sparse_jax/_jagged.py "hybrid/checkpoint/*")
read -r -a pick <<< "${MODULES:-${ORDER[*]}}"
for m in "${pick[@]}"; do
  [[ -n ${TESTS[$m]:-} ]] || { echo "no test selection for $m (see tools/mutation_core.sh)"; exit 2; }
  echo "== $m"
  # shellcheck disable=SC2086
  "$ROOT/tools/mutation.sh" "$m" ${TESTS[$m]}
done
