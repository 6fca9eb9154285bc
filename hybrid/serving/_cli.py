"""`python -m hybrid.serving`: score a JSON-lines file of requests with an exported model.

    python -m hybrid.serving --artifact artifacts/dlrm --requests requests.jsonl --out scores.jsonl
    python -m hybrid.serving serve --artifact artifacts/dlrm --port 8000   # over HTTP: `_server`

Each request line is one sample: `{"dense": [n_dense floats], "sparse": {feature: [ids]}}`
(a weighted model: `{feature: {"ids": [...], "weights": [...]}}`). Lines are scored in
batches of `--batch-size` (default: the artifact's max_batch_size); each output line is
`{"score": sigmoid(logit), "logit": logit}` (lists for a tower with several outputs), in
the order of the requests, written to `--out` or printed. Blank lines are skipped. A bad
line (malformed, a feature missing or one the model does not read, an id out of range)
stops the run with exit code 2 and a message naming its line number.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

from hybrid.serving._artifact import ArtifactError
from hybrid.serving._predictor import Predictor, load

__all__ = ["main"]


class _BadRequest(ValueError):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hybrid.serving",
        usage="%(prog)s --artifact DIR --requests FILE [--out FILE] [--batch-size N]\n"
        "       %(prog)s serve --artifact DIR [--port PORT] ...  (HTTP)",
        description=__doc__.split("\n\n")[0],
        epilog="Over HTTP: python -m hybrid.serving serve --artifact DIR [--port 8000 ...] "
        "(see python -m hybrid.serving serve --help).",
    )
    p.add_argument("--artifact", required=True, help="the directory hybrid.export wrote")
    p.add_argument(
        "--requests", required=True, help='JSON lines: {"dense": [...], "sparse": {feature: [ids]}}'
    )
    p.add_argument(
        "--out", default=None, help="write the scores here (JSON lines); default: print them"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="lines per batch (default: the artifact's maximum)",
    )
    return p


def _read(path: str) -> list[tuple[int, dict]]:
    """(line number, request) of every non-blank line."""
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                request = json.loads(line)
            except ValueError as e:
                raise _BadRequest(f"{path} line {number} is not valid json ({e})") from None
            if (
                not isinstance(request, dict)
                or not isinstance(request.get("dense"), list)
                or not isinstance(request.get("sparse"), dict)
            ):
                raise _BadRequest(
                    f'{path} line {number}: a request is {{"dense": [...], "sparse": {{feature: [ids]}}}}'
                )
            out.append((number, request))
    return out


def _batch(lines: Sequence[tuple[int, dict]], features: Sequence[str], weighted: bool):
    """(dense [b, n] lists, sparse {feature: per-sample lists}) of a batch of request lines."""
    sparse: dict = {f: {"ids": [], "weights": []} if weighted else [] for f in features}
    for number, request in lines:
        unknown = sorted(f for f in request["sparse"] if f not in features)
        if unknown:  # as the HTTP server answers: a request line is the same wire form
            raise _BadRequest(
                f"line {number}: unknown feature(s) {unknown}; this model reads {list(features)}"
            )
        missing = [f for f in features if f not in request["sparse"]]
        if missing:
            raise _BadRequest(
                f"line {number} lacks features {missing} (give [] for a feature without ids)"
            )
        for f in features:
            bag = request["sparse"][f]
            if weighted:
                if not isinstance(bag, dict) or not {"ids", "weights"} <= set(bag):
                    raise _BadRequest(
                        f"line {number}, feature {f!r}: the model is weighted; give "
                        '{"ids": [...], "weights": [...]}'
                    )
                sparse[f]["ids"].append(bag["ids"])
                sparse[f]["weights"].append(bag["weights"])
            else:
                sparse[f].append(bag)
    return [request["dense"] for _, request in lines], sparse


def _score(predictor: Predictor, lines, source: str):
    try:
        dense, sparse = _batch(lines, predictor.features, predictor.manifest["is_weighted"])
        logits = predictor(dense, sparse)
    except _BadRequest as e:
        raise _BadRequest(f"{source} {e}") from None
    except (ValueError, TypeError) as e:
        first, last = lines[0][0], lines[-1][0]
        raise _BadRequest(
            f"{source} lines {first}-{last}: {e} (sample k of this batch is the k-th request line from line {first})"
        ) from None
    out = []
    for logit, score in zip(logits.tolist(), torch.sigmoid(logits).tolist(), strict=True):
        one = len(logit) == 1
        out.append({"score": score[0] if one else score, "logit": logit[0] if one else logit})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # the HTTP server: fastapi, uvicorn, prometheus-client (lazily)
        from hybrid.serving._server import main as serve

        return serve(argv[1:])
    args = _parser().parse_args(argv)
    try:
        predictor = load(args.artifact)
        batch = args.batch_size or predictor.max_batch_size
        if not 1 <= batch <= predictor.max_batch_size:
            raise _BadRequest(
                f"--batch-size {batch} is outside [1, {predictor.max_batch_size}] (the artifact's maximum)"
            )
        lines = _read(args.requests)
        scores = []
        for start in range(0, len(lines), batch):
            scores.extend(_score(predictor, lines[start : start + batch], args.requests))
    except (ArtifactError, _BadRequest, OSError) as e:
        print(f"python -m hybrid.serving: {e}", file=sys.stderr)
        return 2
    text = "".join(json.dumps(s) + "\n" for s in scores)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
