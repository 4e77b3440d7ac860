"""Who proposed a draft: THE draft-source names, one place (issue 58). A learned drafter's drafts are `model`'s; the
suffix cache's are its per-request or global index's (`SUFFIX_SOURCE` maps a suffix index's name to its source).
A leaf module: the decoding primitives, the drafters, the metrics and the server all import it.
"""

from __future__ import annotations

__all__ = ["SOURCES", "SOURCE_MODEL", "SOURCE_SUFFIX_GLOBAL", "SOURCE_SUFFIX_REQUEST", "SUFFIX_SOURCE", "source_code"]

SOURCE_MODEL = "model"  # the learned drafter (separate, early_exit, eagle; hybrid's drafted rows)
SOURCE_SUFFIX_REQUEST = "suffix_request"  # the suffix cache's per-request index (the request's own prompt and output)
SOURCE_SUFFIX_GLOBAL = "suffix_global"  # the suffix cache's global index (finished outputs)
SOURCES = (SOURCE_MODEL, SOURCE_SUFFIX_REQUEST, SOURCE_SUFFIX_GLOBAL)
"""Who proposed a drafted token, THE list of draft-source names (`Draft.sources`, `GenerationResult.by_source`,
the bounded `source` label on /metrics, the feedback record's `draft_source`: code j + 1, 0: no draft)."""
SUFFIX_SOURCE = {"request": SOURCE_SUFFIX_REQUEST, "global": SOURCE_SUFFIX_GLOBAL}
"""A suffix index's name (`dvi.drafters.suffix_index.INDEXES`, `SuffixProposal.source`) -> the draft source it is."""


def source_code(source: str | None) -> int:
    """`draft_source` code of a source name (0: nothing drafted)."""
    return 0 if source is None else SOURCES.index(source) + 1
