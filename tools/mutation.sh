#!/usr/bin/env bash
# Mutation-test one module with mutmut 3 (see `make mutation`).
#   tools/mutation.sh MODULE TEST_FILE... [-- MUTMUT_RUN_ARGS]
# e.g. tools/mutation.sh sparse_jax/_validate.py tests/test_jagged.py tests/test_embedding_bag.py
# Works in build/mutation/<module>/ (symlinks to the packages and tests, plus a generated
# pyproject.toml with the [tool.mutmut] section), so each module keeps its own mutants/ cache
# and its own test selection. Survivor diffs go to build/mutation/<module>.survivors.txt.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
[[ $PY == /* ]] || PY=$ROOT/$PY  # make passes a relative path; the run cds into its work dir
MUTMUT=${MUTMUT:-$(dirname "$PY")/mutmut}
module=$1; shift
tests=(); while [[ $# -gt 0 && $1 != -- ]]; do tests+=("$1"); shift; done
[[ ${1:-} == -- ]] && shift
name=$(echo "${module%.py}" | tr '/*' '._')
work=$ROOT/build/mutation/$name
mkdir -p "$work"
for p in sparse_jax hybrid dense_torch tests; do ln -sfn "$ROOT/$p" "$work/$p"; done
q() { printf '"%s", ' "$@" | sed 's/, $//'; }
cat > "$work/pyproject.toml" <<TOML
[tool.mutmut]
# every package goes to mutants/ (nothing may come from the editable install); only_mutate
# picks the module under test
source_paths = ["sparse_jax", "hybrid", "dense_torch"]
only_mutate = ["$module"]
pytest_add_cli_args_test_selection = [$(q "${tests[@]}")]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "tests.mutmut_plugin"]
# fork workers from a server that has imported but never run the tests: XLA never
# initialized there, and no jit cache to hide a mutant
process_isolation = "forkserver"
timeout_multiplier = ${MUTMUT_TIMEOUT_MULTIPLIER:-10.0}
TOML
# pytest's own settings (markers, filterwarnings=error) come from the real pyproject
sed -n '/^\[tool.pytest.ini_options\]/,/^\[/p' "$ROOT/pyproject.toml" | sed '$d' >> "$work/pyproject.toml"
cd "$work"
children=${MUTMUT_CHILDREN:-$(getconf _NPROCESSORS_ONLN)}  # not nproc: it obeys OMP_NUM_THREADS
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONDONTWRITEBYTECODE=1
start=$(date +%s)
# MUTMUT_TIME_LIMIT (s): SIGINT mutmut itself after that long; finished verdicts are kept
${MUTMUT_TIME_LIMIT:+timeout -s INT "$MUTMUT_TIME_LIMIT"} "$MUTMUT" run --max-children "$children" "$@" || true
echo "mutmut wall time: $(( $(date +%s) - start )) s"
"$MUTMUT" export-cicd-stats >/dev/null && cat mutants/mutmut-cicd-stats.json
out=$ROOT/build/mutation/$name.survivors.txt; : > "$out"
"$MUTMUT" results | sed -n 's/^ *\([^:]*\): survived$/\1/p' | sort -u | while read -r m; do
  "$MUTMUT" show "$m" < /dev/null >> "$out"; echo >> "$out"; done
echo "survivors: $(grep -c '^# .*: survived' "$out" || true) -> $out"
