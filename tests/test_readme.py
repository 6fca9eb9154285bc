"""The README is a contract: its Python blocks run as written, in order, in one fresh
session, and every `python -m` / `torchrun` command it shows names a module and flags that
exist (training commands: the arguments parse and the config file is there)."""

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def blocks(kind: str) -> list[tuple[int, str]]:
    """(line number, code) of every fenced block of `kind` in the README."""
    with open(README) as f:
        text = f.read()
    return [
        (text[: m.start()].count("\n") + 1, m.group(2))
        for m in FENCE.finditer(text)
        if m.group(1) == kind
    ]


def test_every_python_block_runs_in_order():
    code = "\n".join(
        f"print('README block at line {line}', flush=True)\n{body}"
        for line, body in blocks("python")
    )
    env = {
        k: v for k, v in os.environ.items() if k != "XLA_FLAGS"
    }  # the README's own lines must set it
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    started = [ln for ln in done.stdout.splitlines() if ln.startswith("README block at line")]
    assert done.returncode == 0, (
        f"{started[-1] if started else 'before the first block'} failed:\n{done.stderr[-3000:]}"
    )
    assert len(started) == len(blocks("python")) >= 6


def _commands() -> list[list[str]]:
    """Every `python -m ...` / `torchrun ... -m ...` line of the README's bash blocks, as
    [module, *args] (comments dropped)."""
    out = []
    for _, body in blocks("bash"):
        for line in body.splitlines():
            words = shlex.split(line, comments=True)
            if "-m" in words and any(w.endswith("python") or w == "torchrun" for w in words[:1]):
                i = words.index("-m")
                out.append(words[i + 1 :])
    return out


def test_the_readme_shows_commands():
    modules = {c[0] for c in _commands()}
    assert {"hybrid.train", "benchmarks.xla_vs_fbgemm", "benchmarks.e2e_step"} <= modules


def _help_groups() -> dict[tuple[str, ...], list[list[str]]]:
    """The README's non-training commands grouped by what answers their `--help`: the module,
    and its subcommand when the first argument is one (`hybrid.serving serve`)."""
    groups: dict[tuple[str, ...], list[list[str]]] = {}
    for module, *args in _commands():
        if module == "hybrid.train":
            continue
        sub = args[:1] if args and re.fullmatch(r"[a-z_]+", args[0]) else []
        groups.setdefault((module, *sub), []).append(args)
    return groups


@pytest.mark.parametrize(
    "command", [c for c in _commands() if c[0] == "hybrid.train"], ids=lambda c: " ".join(c)[:60]
)
def test_every_training_command_parses_and_names_a_config_that_exists(command):
    from hybrid.train import _parser

    parsed = _parser().parse_args(command[1:])  # exits (fails the test) on an unknown flag
    if parsed.config:
        assert os.path.exists(os.path.join(ROOT, parsed.config)), parsed.config


@pytest.mark.parametrize("group", sorted(_help_groups()), ids=" ".join)
def test_every_other_command_names_a_module_and_flags_its_help_lists(group):
    """One `python -m <module> [<subcommand>] --help` per module: it exits 0 and lists every
    long flag the README passes it; every path a pytest command names exists."""
    done = subprocess.run(
        [sys.executable, "-m", *group, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for args in _help_groups()[group]:
        for word in args:
            flag = word.split("=", 1)[0]
            if flag.startswith("--"):
                assert re.search(re.escape(flag) + r"\b", done.stdout), (
                    f"README: `python -m {group[0]} {' '.join(args)}` passes {flag}, which "
                    f"`{' '.join(group)} --help` does not list"
                )
            elif group[0] == "pytest" and word.startswith("tests/"):
                assert os.path.exists(os.path.join(ROOT, word.split("::")[0])), word


def test_every_make_command_names_a_target_and_variables_the_makefile_has():
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    variables = set(re.findall(r"^(\w+)\s*[?:]?=", makefile, re.M))
    seen = 0
    for _, body in blocks("bash"):
        for line in body.splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] != ["make"]:
                continue
            seen += 1
            for word in words[1:]:
                if "=" in word:
                    assert word.split("=", 1)[0] in variables, (
                        f"README: `{line}` sets a variable the Makefile lacks"
                    )
                else:
                    assert word in targets, f"README: `{line}` names a target the Makefile lacks"
    assert seen >= 3


def test_the_first_screen_says_what_it_is_how_to_run_it_how_long_and_how_to_run_a_subset():
    """A newcomer's first screen: what the project is, the two commands with their times and
    outputs, a quick test subset; the install and GPU details come later."""
    with open(README) as f:
        first = "\n".join(f.read().splitlines()[:45])
    for must in (
        "TorchRec-style",
        "JAX",
        "PyTorch",
        "zero-copy",
        "make train",
        "make test",
        "4 minutes",
        "15 minutes",
        "metrics: data_cache/runs/movielens/metrics.jsonl",
        "--overwrite",
        "python -m pytest -q tests/test_jagged.py",
        " -k ",
    ):
        assert must in first, must
    for later in ("jaxlib", "PTX", "nvptx", "CUDA"):
        assert later not in first, later
