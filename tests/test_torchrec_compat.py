"""docs/torchrec_compat.md lists every public name of TorchRec's sparse classes, and what it
says exists does exist on ours (the doc cannot fall behind TorchRec or behind the code)."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

torchrec = pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import torch  # noqa: E402
from torchrec.modules import embedding_configs as tr_configs  # noqa: E402
from torchrec.modules import embedding_modules as tr_modules  # noqa: E402
from torchrec.sparse import jagged_tensor as tr  # noqa: E402

import dense_torch  # noqa: E402
import sparse_jax as sj  # noqa: E402

pytestmark = pytest.mark.parity

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "torchrec_compat.md"
CLASSES = {  # TorchRec class -> ours (the doc's section that covers it)
    tr.JaggedTensor: ([sj.JaggedTensor], "JaggedTensor"),
    tr.KeyedJaggedTensor: ([sj.KeyedJaggedTensor], "KeyedJaggedTensor"),
    tr.KeyedTensor: ([sj.KeyedTensor, dense_torch.KeyedTensor], "KeyedTensor"),
    tr_configs.EmbeddingBagConfig: (
        [sj.EmbeddingBagConfig],
        "EmbeddingBagConfig and EmbeddingConfig",
    ),
    tr_configs.EmbeddingConfig: ([sj.EmbeddingConfig], "EmbeddingBagConfig and EmbeddingConfig"),
    tr_modules.EmbeddingBagCollection: ([sj.EmbeddingBagCollection], "EmbeddingBagCollection"),
    tr_modules.EmbeddingCollection: ([sj.EmbeddingCollection], "EmbeddingCollection"),
}
STATUSES = {"same", "different", "n/a"}


def torchrec_public_names(cls) -> set[str]:
    """Public names `cls` and its TorchRec bases define (not torch.nn.Module's or object's)."""
    names = set()
    for base in cls.__mro__:
        if base.__module__.startswith("torchrec"):
            names |= {n for n in vars(base) if not n.startswith("_")}
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    return names - set(dir(torch.nn.Module)) - set(dir(object))


def doc_tables() -> dict[str, dict[str, str]]:
    """{section heading: {name: status}} from the doc's tables."""
    sections: dict[str, dict[str, str]] = {}
    current = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip(), {})
        m = re.match(r"\| `(\w+)` \| ([\w/]+) \|", line)
        if m:
            assert current is not None, line
            assert m[1] not in current, f"{m[1]} listed twice under {line}"
            current[m[1]] = m[2]
    return sections


def test_every_torchrec_name_is_in_the_table_and_exists_unless_not_applicable():
    sections = doc_tables()
    for cls, (ours, section) in CLASSES.items():
        table = sections[section]
        assert set(table.values()) <= STATUSES, table
        names = torchrec_public_names(cls)
        assert len(names) >= 4, (cls, names)  # the introspection found the class's API
        missing = sorted(names - set(table))
        assert not missing, (
            f"docs/torchrec_compat.md, section {section!r}, lacks TorchRec names {missing}"
        )
        for name in sorted(names):
            if table[name] in ("same", "different"):
                has = [
                    hasattr(o, name) or name in getattr(o, "__dataclass_fields__", {}) for o in ours
                ]
                if cls is tr.KeyedTensor and name == "record_stream":
                    has = has[1:]  # only the torch KeyedTensor has it (documented)
                assert all(has), f"{section}.{name} is marked {table[name]} but missing from {ours}"
            else:
                assert not any(hasattr(o, name) for o in ours), (
                    f"{name} is marked n/a but {ours} has it"
                )


def test_the_table_lists_no_name_torchrec_lacks():
    sections = doc_tables()
    known = {}
    for cls, (_, section) in CLASSES.items():
        known.setdefault(section, set()).update(torchrec_public_names(cls))
    for section, names in known.items():
        extra = sorted(set(sections[section]) - names)
        assert not extra, f"section {section!r} lists {extra}, which TorchRec 1.8 does not have"
