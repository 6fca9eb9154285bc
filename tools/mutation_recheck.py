"""Run named mutmut mutants again, directly, against the current tests (see docs/mutation.md).

    .venv/bin/python tools/mutation_recheck.py build/mutation/<module> MUTATED NAMES OUT "stage 1 tests" ["stage 2 tests" ...]

MUTATED: the mutated module's path (e.g. hybrid/model/_bridge.py; a glob like
sparse_jax/optim/* for a package); every other tracked source and test file is copied
into the run's mutants/ first, so only the mutated module differs from the tree. NAMES: a
file with one mutant name per line. Each stage must pass on the clean tree; a mutant
killed by a stage is not run by later ones. OUT gets `name: killed|survived [stage]`
lines. WORKERS=N runs N pytest processes at once. mutmut's own verdicts miss tests written
after its run started, and its coverage stats can miss tests that need the 8-device mesh:
this re-check is what the scores in docs/mutation.md rest on."""

import concurrent.futures
import fnmatch
import os
import shutil
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = os.path.join(ROOT, ".venv", "bin", "python")


def sync(work: str, mutated: str) -> None:
    files = subprocess.run(
        ["git", "ls-files", "sparse_jax", "hybrid", "dense_torch", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for f in files:
        if f.endswith(".py") and not fnmatch.fnmatch(f, mutated):
            os.makedirs(os.path.join(work, "mutants", os.path.dirname(f)), exist_ok=True)
            shutil.copy(os.path.join(ROOT, f), os.path.join(work, "mutants", f))


def main(work, mutated, names_file, out_file, *stages) -> int:
    sync(work, mutated)
    names = [n.strip() for n in open(names_file) if n.strip()]
    env = dict(
        os.environ,
        HYBRIDREC_DIFF_CASES=os.environ.get("HYBRIDREC_DIFF_CASES", "60"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    cwd, lock, verdict = os.path.join(work, "mutants"), threading.Lock(), {}
    for stage in stages:
        cmd = [PY, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *stage.split()]
        clean = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
        if clean.returncode != 0:
            sys.exit(f"the clean tree fails {stage!r} in {cwd}:\n{clean.stdout[-2000:]}")

        def one(name, cmd=cmd, stage=stage):
            r = subprocess.run(
                cmd, cwd=cwd, env={**env, "MUTANT_UNDER_TEST": name}, capture_output=True, text=True
            )
            v = "survived" if r.returncode == 0 else "killed"
            with lock:
                verdict[name] = v
                with open(out_file, "a") as f:
                    f.write(f"{name}: {v} [{stage.split()[0]}]\n")

        todo = [n for n in names if verdict.get(n) != "killed"]
        with concurrent.futures.ThreadPoolExecutor(int(os.environ.get("WORKERS", "1"))) as pool:
            list(pool.map(one, todo))
    killed = sum(v == "killed" for v in verdict.values())
    print(
        f"{killed} of {len(names)} killed; survivors: {[n for n, v in verdict.items() if v != 'killed']}"
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 6:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
