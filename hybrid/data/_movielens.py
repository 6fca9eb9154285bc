"""MovieLens-100K as a click task, from the copy shipped inside the `recbole==1.2.1` wheel.

The wheel is fetched once with `pip download --no-deps recbole==1.2.1` (a subprocess; the
package is never installed or imported) into the cache directory, the three files
`recbole/dataset_example/ml-100k/ml-100k.{inter,user,item}` are read with `zipfile`, and
the prepared arrays are cached as `movielens100k_v1.npz` beside the wheel.

Both artifacts are verified before use. The wheel must hash to `WHEEL_SHA256` (the
sha256 of the file PyPI serves for recbole 1.2.1); any other file is refused with an
error naming it, both hashes, and telling to delete it so it is downloaded again. The
`.npz` is written first, then a sidecar `movielens100k_v1.json` recording the npz's sha256
and the wheel's; on reuse the npz bytes must match that record and load cleanly, otherwise
(missing or stale record, edited, truncated or corrupt npz) it is rebuilt from the wheel
with a warning on the `hybridrec.data` logger -- never a raw traceback.

Task: click = rating >= 4. Sparse features (one table each, id 0 = unknown):
user, item, gender, occupation, zip, age_bucket (one id per sample) and genres (multi-hot:
the item's genres, 1..6 ids). Dense features: age, timestamp, release year (missing ->
the training mean), each standardized with the training split's mean and std.
Split: interactions sorted by (timestamp, user, item); the last 20% are the eval set.

Cache directory: `$HYBRIDREC_DATA` if set, else `data_cache/` at the repository root
(git-ignored). Nothing here is ever committed.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence

import numpy as np

from hybrid._files import sha256_file, write_atomic
from hybrid.data._arrays import ClickData

__all__ = ["MOVIELENS_FEATURES", "data_cache_dir", "load_movielens", "raw_id"]

log = logging.getLogger("hybridrec.data")

WHEEL = "recbole-1.2.1-py3-none-any.whl"
# sha256 of recbole-1.2.1-py3-none-any.whl as served by PyPI (checked 2026-11-23 against a
# fresh `pip download`); pinned so a corrupt, truncated or substituted wheel is refused.
WHEEL_SHA256 = "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"
_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.{}"
_CACHE_NAME = "movielens100k_v1.npz"
_RECORD_NAME = "movielens100k_v1.json"  # sidecar: sha256 of the npz (and of its wheel)
MOVIELENS_FEATURES = ("user", "item", "gender", "occupation", "zip", "age_bucket", "genres")
_AGE_EDGES = np.array([18, 25, 35, 45, 50, 56])  # MovieLens-1M's age groups


def data_cache_dir() -> pathlib.Path:
    env = os.environ.get("HYBRIDREC_DATA")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(__file__).resolve().parents[2] / "data_cache"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _verify_wheel(path: pathlib.Path) -> pathlib.Path:
    """`path` if its sha256 is `WHEEL_SHA256`; else RuntimeError naming file and both hashes."""
    actual = sha256_file(path)
    if actual != WHEEL_SHA256:
        raise RuntimeError(
            f"{path}: sha256 mismatch for the MovieLens source wheel (recbole==1.2.1): expected "
            f"{WHEEL_SHA256}, got {actual}. The file is corrupt, truncated or not the published "
            f"wheel; delete it to re-download it (or put the genuine {WHEEL} there by hand)."
        )
    return path


def _wheel(cache: pathlib.Path) -> pathlib.Path:
    """The verified wheel in `cache`, downloaded first when absent. pip writes into a fresh
    folder of its own, and the verified file is then renamed into place: processes that
    start together (the ranks of one job, two test workers) never read a half-written wheel,
    and each rename puts the same bytes there."""
    path = cache / WHEEL
    if path.is_file():
        return _verify_wheel(path)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as folder:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "recbole==1.2.1", "-d", folder]
        done = subprocess.run(cmd, capture_output=True, text=True)
        fetched = pathlib.Path(folder) / WHEEL
        if done.returncode != 0 or not fetched.exists():
            raise RuntimeError(
                f"could not download MovieLens-100K ({' '.join(cmd)} exited {done.returncode}):\n"
                f"{done.stderr[-2000:]}\nPut {WHEEL} into {cache} by hand, or set HYBRIDREC_DATA "
                "to a directory holding it"
            )
        os.replace(_verify_wheel(fetched), path)
    return path


def _table(z: zipfile.ZipFile, ext: str) -> dict[str, list[str]]:
    """A typed-header TSV (`user_id:token\\t...`) as {column name: values}."""
    name = _MEMBER.format(ext)
    text = z.read(name).decode("latin-1")
    lines = text.rstrip("\n").split("\n")
    header = [h.split(":")[0] for h in lines[0].split("\t")]
    columns: list[list[str]] = [[] for _ in header]
    for number, line in enumerate(lines[1:], start=2):
        fields = line.split("\t")
        if len(fields) != len(header):
            raise ValueError(
                f"{name} line {number}: {len(fields)} fields, the header names {len(header)}"
            )
        for column, field in zip(columns, fields, strict=True):
            column.append(field)
    return dict(zip(header, columns, strict=True))


def _vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id, 1-based in sorted order (0 is reserved for unknown)."""
    return {t: i + 1 for i, t in enumerate(sorted(set(tokens)))}


def _prepare(wheel: pathlib.Path) -> dict[str, np.ndarray]:
    with zipfile.ZipFile(wheel) as z:
        inter, users, items = _table(z, "inter"), _table(z, "user"), _table(z, "item")
    n = len(inter["user_id"])
    user_vocab = _vocab(users["user_id"])
    item_vocab = _vocab(items["item_id"])
    user_row = {u: i for i, u in enumerate(users["user_id"])}
    item_row = {it: i for i, it in enumerate(items["item_id"])}
    gender_vocab, occ_vocab, zip_vocab = (
        _vocab(users[c]) for c in ("gender", "occupation", "zip_code")
    )
    genre_lists = [g.split() for g in items["class"]]
    genre_vocab = _vocab([g for gs in genre_lists for g in gs])

    ts = np.array(inter["timestamp"], np.float64)
    u_tok, i_tok = inter["user_id"], inter["item_id"]
    order = np.lexsort((np.array([int(t) for t in i_tok]), np.array([int(t) for t in u_tok]), ts))
    rating = np.array(inter["rating"], np.float64)[order]
    ts = ts[order]
    u_tok = [u_tok[i] for i in order]
    i_tok = [i_tok[i] for i in order]
    urow = np.array([user_row.get(u, -1) for u in u_tok])
    irow = np.array([item_row.get(it, -1) for it in i_tok])

    def user_attr(column: str, vocab: dict[str, int]) -> np.ndarray:
        values = np.array([vocab[v] for v in users[column]], np.int64)
        return np.where(urow >= 0, values[urow], 0)

    ages = np.array([float(a) for a in users["age"]])
    age = np.where(urow >= 0, ages[urow], np.nan)
    years = np.array([float(y) if y.strip().isdigit() else np.nan for y in items["release_year"]])
    year = np.where(irow >= 0, years[irow], np.nan)
    genres = [genre_lists[r] if r >= 0 else [] for r in irow]
    genre_lengths = np.array([max(1, len(g)) for g in genres], np.int64)
    # an item without genres (or unknown) gets one bag entry: id 0, "unknown"
    genre_ids = np.array([genre_vocab.get(x, 0) for g in genres for x in (g or ["?"])], np.int64)
    singles = {
        "user": np.array([user_vocab.get(u, 0) for u in u_tok], np.int64),
        "item": np.array([item_vocab.get(it, 0) for it in i_tok], np.int64),
        "gender": user_attr("gender", gender_vocab),
        "occupation": user_attr("occupation", occ_vocab),
        "zip": user_attr("zip_code", zip_vocab),
        "age_bucket": np.where(
            np.isnan(age), 0, np.searchsorted(_AGE_EDGES, age, side="right") + 1
        ),
    }
    sizes = {
        "user": len(user_vocab) + 1,
        "item": len(item_vocab) + 1,
        "gender": len(gender_vocab) + 1,
        "occupation": len(occ_vocab) + 1,
        "zip": len(zip_vocab) + 1,
        "age_bucket": len(_AGE_EDGES) + 2,
        "genres": len(genre_vocab) + 1,
    }
    n_train = int(round(0.8 * n))
    raw_dense = np.stack([age, ts, year], axis=1)
    train_part = raw_dense[:n_train]
    mean = np.nanmean(train_part, axis=0)
    std = np.nanstd(train_part, axis=0)
    dense = np.where(np.isnan(raw_dense), mean, raw_dense)
    dense = ((dense - mean) / np.where(std > 0, std, 1.0)).astype(np.float32)
    labels = (rating >= 4).astype(np.float32)
    lengths = np.stack([np.ones(n, np.int64)] * len(singles) + [genre_lengths])
    data = ClickData(
        MOVIELENS_FEATURES,
        dense,
        tuple(singles[k].astype(np.int64) for k in MOVIELENS_FEATURES[:-1]) + (genre_ids,),
        lengths,
        labels,
        tuple(sizes[k] for k in MOVIELENS_FEATURES),
    )
    train, evaluation = data.take(np.arange(n_train)), data.take(np.arange(n_train, n))
    return {**train.to_arrays("train_"), **evaluation.to_arrays("eval_")}


def _write_cache(prepared: pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
    """The npz, then its sidecar record (so a record never vouches for an unwritten npz)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    data = buffer.getvalue()
    write_atomic(prepared, data)
    record = {
        "format": 1,
        "npz": prepared.name,
        "npz_sha256": _sha256(data),
        "npz_bytes": len(data),
        "wheel_sha256": WHEEL_SHA256,
    }
    write_atomic(prepared.with_name(_RECORD_NAME), (json.dumps(record, indent=1) + "\n").encode())


def _read_cache(prepared: pathlib.Path) -> dict[str, np.ndarray] | None:
    """The cached arrays if the npz matches its sidecar record and loads; else None, with
    the reason logged (the caller rebuilds)."""
    record_path = prepared.with_name(_RECORD_NAME)
    if not prepared.exists():
        return None
    try:
        record = json.loads(record_path.read_text())
        expected = record["npz_sha256"]
        wheel_sha = record["wheel_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        problem = f"its checksum record {record_path} is missing or unreadable ({type(err).__name__}: {err})"
    else:
        try:
            data = prepared.read_bytes()
        except OSError as err:
            problem = f"it cannot be read ({err})"
        else:
            actual = _sha256(data)
            if wheel_sha != WHEEL_SHA256:
                problem = f"it was built from a different wheel (sha256 {wheel_sha})"
            elif actual != expected:
                problem = f"its sha256 is {actual}, the record {record_path.name} says {expected} (edited, truncated or corrupt)"
            else:
                try:
                    with np.load(io.BytesIO(data)) as npz:
                        arrays = {k: npz[k] for k in npz.files}
                    ClickData.from_arrays(arrays, "train_"), ClickData.from_arrays(arrays, "eval_")
                    return arrays
                except Exception as err:  # noqa: BLE001 -- any unreadable cache is rebuilt
                    problem = f"it does not load ({type(err).__name__}: {err})"
    log.warning(
        "MovieLens cache %s is not reused, rebuilding it from the wheel: %s", prepared, problem
    )
    return None


def load_movielens(
    cache_dir: str | os.PathLike | None = None, *, raw_ids: Sequence[str] = ()
) -> tuple[ClickData, ClickData]:
    """`(train, eval)` MovieLens-100K click data (see the module docstring).

    `raw_ids`: features (e.g. `["user", "item"]`) whose ids come as raw 64-bit ids instead
    of rows of a vocabulary-sized table (`num_embeddings` 0): each value's id is a 64-bit
    hash of the feature name and the value (its vocabulary index, one to one with the
    value), so nothing tells the model how many users or items there are."""
    unknown = sorted(set(raw_ids) - set(MOVIELENS_FEATURES))
    if unknown:
        raise ValueError(
            f"load_movielens: raw_ids names {unknown}, not MovieLens features {list(MOVIELENS_FEATURES)}"
        )
    cache = pathlib.Path(cache_dir) if cache_dir else data_cache_dir()
    prepared = cache / _CACHE_NAME
    arrays = _read_cache(prepared)
    if arrays is None:
        arrays = _prepare(_wheel(cache))
        _write_cache(prepared, arrays)
    return tuple(
        _with_raw_ids(ClickData.from_arrays(arrays, part), raw_ids) for part in ("train_", "eval_")
    )


def raw_id(feature: str, index: np.ndarray) -> np.ndarray:
    """The raw 64-bit id of `feature`'s vocabulary `index`es: splitmix64 of a per-feature
    salt plus the index, as int64 (never `2**63 - 1`, reserved by managed collision)."""
    salt = np.uint64(
        int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")
    )
    with np.errstate(over="ignore"):
        x = np.asarray(index, np.uint64) + salt
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    ids = x.view(np.int64)
    return np.where(ids == np.iinfo(np.int64).max, np.iinfo(np.int64).max - 1, ids)


def _with_raw_ids(data: ClickData, raw_ids: Sequence[str]) -> ClickData:
    if not raw_ids:
        return data
    values = tuple(
        raw_id(k, v) if k in raw_ids else v for k, v in zip(data.keys, data.values, strict=True)
    )
    sizes = tuple(
        0 if k in raw_ids else n for k, n in zip(data.keys, data.num_embeddings, strict=True)
    )
    return ClickData(data.keys, data.dense, values, data.lengths, data.labels, sizes)
