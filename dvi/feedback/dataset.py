"""The feedback log as a Hugging Face `datasets.Dataset`, for analysis: slice acceptance by domain, client, drafter or
target version, temperature or prompt with the tooling users know (`filter`, `map`, `to_pandas`, `push_to_hub`).

    from dvi.feedback.dataset import open_feedback
    ds = open_feedback("runs/default/feedback")          # or a run dir, or an fsspec URL
    ds.filter(lambda r: r["domain"] == "sql")

Read only: the same shards and columns the trainer reads (`dvi.feedback.record.SCHEMA`, one row per finished
request; see docs/contracts.md "Feedback record"), consumed or not, and it never moves, quarantines or counts a
shard (a damaged one is skipped with a warning). Four columns are derived per row: `num_tokens`, `num_drafted`
(positions whose token had a draft: the accepted drafts and each step's first rejected one), `num_accepted` and
`alpha` = num_accepted / num_drafted (None where nothing was drafted), the per-position rate the shadow check and
`dvi report` use (the engine's α also counts a step's drafts after its first rejection, which no record holds).
"""

from __future__ import annotations

import logging
import os
import posixpath
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dvi.feedback.record import SCHEMA
from dvi.feedback.storage import _fs, _list_shards

__all__ = ["DERIVED", "acceptance_by", "feedback_dir_of", "open_feedback"]

log = logging.getLogger(__name__)

DERIVED = ("num_tokens", "num_drafted", "num_accepted", "alpha")


def feedback_dir_of(path: str | os.PathLike) -> str:
    """A feedback dir given itself or a run dir: the run's resolved config names it (`trainer_config.yaml`, a
    supervised trainer's), else `<run dir>/feedback` where that holds shards, else `path` itself."""
    p = Path(path)
    cfg = p / "trainer_config.yaml"
    if cfg.is_file():
        import yaml

        named = ((yaml.safe_load(cfg.read_text()) or {}).get("feedback") or {}).get("dir")
        if named:
            return str(named)
    if (p / "feedback").is_dir() and any(n.endswith(".parquet") for n in os.listdir(p / "feedback")):
        return str(p / "feedback")
    return os.fspath(path)


def _table(root: str) -> pa.Table:
    fs, path = _fs(root)
    tables = []
    for name, _ in _list_shards(fs, path):
        try:
            with fs.open(posixpath.join(path, name), "rb") as f:
                tables.append(pq.read_table(f, schema=SCHEMA))
        except (OSError, pa.ArrowException, ValueError) as exc:
            log.warning("feedback shard %s skipped: %s: %s", name, type(exc).__name__, exc)
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def _derived(table: pa.Table) -> pa.Table:
    """`DERIVED` appended, from the token, draft and accept lists alone (not the top-k rows)."""
    cols = table.select(["token_ids", "drafted_ids", "accepted"]).to_pydict()
    drafted = [sum(1 for d in ids if d >= 0) for ids in cols["drafted_ids"]]
    accepted = [sum(1 for a in acc if a) for acc in cols["accepted"]]
    return (table.append_column("num_tokens", pa.array([len(t) for t in cols["token_ids"]], pa.int64()))
            .append_column("num_drafted", pa.array(drafted, pa.int64()))
            .append_column("num_accepted", pa.array(accepted, pa.int64()))
            .append_column("alpha", pa.array([a / d if d else None for a, d in zip(accepted, drafted, strict=True)],
                                             pa.float64())))


def open_feedback(path: str | os.PathLike) -> Any:
    """Every feedback record under `path` (a feedback dir, an fsspec URL or a run dir) as a `datasets.Dataset`."""
    import datasets

    root = feedback_dir_of(path)
    return datasets.Dataset(_derived(_table(root)))


def acceptance_by(ds: Any, keys: tuple[str, ...] = ("domain", "drafter_version")) -> list[dict]:
    """Per value of `keys`: records, tokens, drafted and accepted positions, α (what `dvi report` prints)."""
    cols = ds.select_columns([*keys, "num_tokens", "num_drafted", "num_accepted"]).to_dict()
    groups: dict[tuple, list[int]] = {}
    for i in range(len(ds)):
        g = groups.setdefault(tuple(cols[k][i] for k in keys), [0, 0, 0, 0])
        g[0], g[1] = g[0] + 1, g[1] + cols["num_tokens"][i]
        g[2], g[3] = g[2] + cols["num_drafted"][i], g[3] + cols["num_accepted"][i]
    return [{**dict(zip(keys, k, strict=True)), "records": r, "tokens": t, "drafted": d, "accepted": a,
             "alpha": a / d if d else None} for k, (r, t, d, a) in sorted(groups.items(), key=lambda x: str(x[0]))]
