"""The server's request and response formats: JSON, and safetensors for compact binary.

JSON (any content type but the binary one, so `curl -d` works):
  `{"dense": [[n_dense floats], ...], "sparse": {feature: [[ids], ...]}}` (several samples)
  or `{"dense": [floats], "sparse": {feature: [ids]}}` (one); a weighted model's feature is
  `{"ids": ..., "weights": ...}`. Answer: `{"scores": [...], "logits": [...], "model": {...}}`.

Binary (`Content-Type: application/x-safetensors`): the body is a safetensors buffer (the
  ML field's plain tensor container: a JSON header of names, dtypes, shapes and offsets, then
  the raw bytes; `safetensors.numpy.save(...)`, or `safetensors.torch.save(...)`), holding
  `dense` `[B, n_dense]` and, per feature, `<feature>.values` (its ids, sample after sample),
  `<feature>.lengths` (ids per sample, `[B]`) and, for a weighted model, `<feature>.weights`:
  the flat form `hybrid.Model` and `Predictor` take, parsed in tens of microseconds whatever
  the batch (JSON takes ~0.4 ms for 64 samples of 8 features of 10 ids) and read without a
  loop over samples or ids. With `Accept: application/x-safetensors` the answer is one too,
  of `scores` and `logits` (float32; `[B]` for one output, else `[B, outputs]`), the model
  in its metadata (`artifact`, `generation`) and in the headers `X-Model-Artifact` and
  `X-Model-Generation`. Errors are JSON either way.

Both become the same `Payload` of arrays (after the predictor's own checks), so JSON and
binary requests share predictor calls.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import safetensors.numpy
import torch
from fastapi.responses import JSONResponse, Response

from hybrid.serving._request import RequestError, columns

__all__ = ["BINARY", "Payload", "is_binary", "parse", "payload", "render", "score"]

BINARY = "application/x-safetensors"
_PARTS = ("values", "lengths", "weights")


class Payload(NamedTuple):
    """One checked request as arrays: dense `[samples, n_dense]`, and per feature (values
    int64, lengths int64, weights float32 or None)."""

    dense: np.ndarray
    sparse: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]
    samples: int


def is_binary(media_type: str | None) -> bool:
    """Whether a Content-Type / Accept header names the binary format."""
    return any(
        part.split(";", 1)[0].strip().lower() == BINARY for part in (media_type or "").split(",")
    )


def _no_constant(name: str):
    raise ValueError(f"{name} is not a json number")


def _one_sample(entry):
    """A single-sample request's feature entry as the per-sample form (a list of one bag)."""
    if isinstance(entry, dict):
        return {k: [v] for k, v in entry.items() if k in ("ids", "weights")}
    return [entry]


def _unknown(features: Sequence[str], known: Sequence[str]) -> None:
    unknown = sorted(f for f in features if f not in known)
    if unknown:
        raise RequestError(
            "unknown_feature", f"unknown feature(s) {unknown}; this model reads {list(known)}"
        )


def _parse_json(body: bytes, features: Sequence[str]) -> tuple[Any, dict]:
    try:
        request = json.loads(body, parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity
        raise RequestError("malformed_json", f"the body is not valid json ({e})") from None
    if (
        not isinstance(request, dict)
        or not isinstance(request.get("dense"), list)
        or not isinstance(request.get("sparse"), dict)
    ):
        raise RequestError(
            "malformed",
            'a request is {"dense": [[floats], ...], "sparse": {feature: [[ids], ...]}} '
            '(several samples) or {"dense": [floats], "sparse": {feature: [ids]}} (one)',
        )
    dense, sparse = request["dense"], request["sparse"]
    _unknown(sparse, features)
    if not dense or not isinstance(dense[0], list):  # one sample
        dense, sparse = [dense], {f: _one_sample(v) for f, v in sparse.items()}
    return dense, sparse


def _parse_binary(body: bytes, features: Sequence[str]) -> tuple[Any, dict]:
    how = (
        "a binary request is safetensors.numpy.save({'dense': [B, n_dense], '<feature>.values': "
        "ids, '<feature>.lengths': [B], ...}) (and '<feature>.weights' for a weighted model)"
    )
    try:
        arrays = safetensors.numpy.load(body)
    except Exception as e:  # SafetensorError, or a dtype numpy lacks (bf16)
        raise RequestError(
            "malformed", f"the body is not a safetensors buffer ({type(e).__name__}: {e}); {how}"
        ) from None
    if "dense" not in arrays:
        raise RequestError("malformed", f"the buffer has no 'dense' tensor; {how}")
    parts: dict[str, dict[str, np.ndarray]] = {}
    for name, array in arrays.items():
        if name == "dense":
            continue
        feature, _, part = name.rpartition(".")
        if not feature or part not in _PARTS:
            raise RequestError(
                "malformed",
                f"the buffer's tensor {name!r} is not 'dense' nor one of '<feature>.values', "
                f"'<feature>.lengths', '<feature>.weights'; {how}",
            )
        parts.setdefault(feature, {})[part] = array
    _unknown(parts, features)
    sparse = {}
    for f, got in parts.items():
        if "values" not in got or "lengths" not in got:
            raise RequestError(
                "malformed", f"feature {f!r} needs both '{f}.values' and '{f}.lengths'; {how}"
            )
        sparse[f] = (got["values"], got["lengths"]) + (
            (got["weights"],) if "weights" in got else ()
        )
    return arrays["dense"], sparse


def parse(body: bytes, media_type: str | None, features: Sequence[str]):
    """(dense, sparse) of a request body in the format its Content-Type names, in a form
    the predictor reads (its checks come next); the wrong structure raises RequestError."""
    if is_binary(media_type):
        return _parse_binary(body, features)
    return _parse_json(body, features)


def payload(
    dense, sparse: Mapping, samples: int, features: Sequence[str], weighted: bool
) -> Payload:
    """A request the predictor has checked (`check(dense, sparse)`), as arrays: its columns
    as the predictor's own reader takes them (`_request.columns`: per-sample lists or flat
    arrays), the ids as int64."""
    read = columns(sparse)
    cols = {}
    for f in features:
        c = read[f]
        cols[f] = (
            c.values.astype(np.int64, copy=False),
            c.lengths,
            None if not weighted or c.weights is None else np.asarray(c.weights, np.float32),
        )
    dense = np.asarray(dense)
    return Payload(dense if dense.dtype.kind == "f" else dense.astype(np.float64), cols, samples)


def score(predictor, payloads: Sequence[Payload]) -> list[dict[str, np.ndarray]]:
    """One predictor call for a batch of payloads; per payload its scores and logits
    (float32; `[samples]` for one output, else `[samples, outputs]`)."""
    one = len(payloads) == 1
    dense = payloads[0].dense if one else np.concatenate([p.dense for p in payloads])
    sparse = {}
    for f in predictor.features:
        parts = [p.sparse[f] for p in payloads]
        values = parts[0][0] if one else np.concatenate([c[0] for c in parts])
        lengths = parts[0][1] if one else np.concatenate([c[1] for c in parts])
        if predictor.manifest["is_weighted"]:
            sparse[f] = (values, lengths, np.concatenate([c[2] for c in parts]))
        else:
            sparse[f] = (values, lengths)
    logits = predictor(dense, sparse)
    scores = torch.sigmoid(logits)
    if logits.shape[1] == 1:
        logits, scores = logits[:, 0], scores[:, 0]
    logits, scores = logits.float().numpy(), scores.float().numpy()
    out, start = [], 0
    for p in payloads:
        end = start + p.samples
        out.append({"scores": scores[start:end], "logits": logits[start:end]})
        start = end
    return out


def _finite(values: list) -> list:
    """Non-finite outputs (a model can overflow) as null: json has no NaN or Infinity."""
    return [
        _finite(v) if isinstance(v, list) else (v if math.isfinite(v) else None) for v in values
    ]


def render(result: dict[str, np.ndarray], model: dict, binary: bool) -> Response:
    """The answer to a scored request: JSON, or (`binary`) safetensors of scores and logits."""
    if binary:
        about = {"artifact": str(model["artifact"]), "generation": str(model["generation"])}
        body = safetensors.numpy.save(
            {"scores": result["scores"], "logits": result["logits"]}, metadata=about
        )
        headers = {"X-Model-Artifact": about["artifact"], "X-Model-Generation": about["generation"]}
        return Response(body, media_type=BINARY, headers=headers)
    return JSONResponse(
        {
            "scores": _finite(result["scores"].tolist()),
            "logits": _finite(result["logits"].tolist()),
            "model": model,
        }
    )
