"""`eagle`: a head (`dvi.drafters.eagle`) that reads, per input token, the target's feature of the position before.

Rows keep their features (the verify pass returns them) and log them in the finished record (`hidden`). Drafted
entries always leave the head's cache after verification; accepted tokens are re-fed with true features.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dvi.drafters.draft_cache import DraftCache, RaggedDraftCache
from dvi.drafters.model_proposer import ModelProposer
from dvi.drafters.proposer import Draft

if TYPE_CHECKING:
    from dvi.decode.seq import BatchParams, Seq

__all__ = ["EagleProposer"]


class EagleProposer(ModelProposer):
    needs_features = True

    def __init__(self, drafter, vocab_size: int, device: torch.device):
        super().__init__(drafter, vocab_size, device)
        self.feats: list[list[torch.Tensor]] = []  # per row, chunks [n, H] of its features f_0..f_{L-2}

    def _new_cache(self) -> DraftCache:
        return RaggedDraftCache(self.drafter)

    def join(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None) -> None:
        super().join(seqs, feats)
        self.feats.extend([f] if f is not None and f.shape[0] else [] for f in (feats or [None] * len(seqs)))

    def release(self, finished: list[tuple[int, Seq, bool]], keep: list[int]) -> None:
        """A finished row's features f_0..f_{L-2}, fp16 on the host, go to its feedback record."""
        for i, seq, _ in finished:
            if self.feats[i]:  # the head's input projection (H wide: a fused head's `fuse` applied)
                seq.res.hidden = self._project(torch.cat(self.feats[i])).to("cpu", torch.float16)
        super().release(finished, keep)
        self.feats = [self.feats[i] for i in keep]

    def rebuild(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None = None,
                target_version: int | None = None, drafter_changed: bool = False) -> None:
        """New features (the target's cache was recomputed) replace the rows'; the head's cache is refilled
        lazily, as at admission: every token pending, fed with its true feature."""
        if feats is not None:
            self.feats = [[f] if f is not None and f.shape[0] else [] for f in feats]
        if drafter_changed or target_version is not None:
            self.dkv = self._new_cache()
            self.dkv.add_rows(len(seqs))
            self.pending = [s.tokens() for s in seqs]
            if len(self.feats) != len(seqs):
                self.feats = [[] for _ in seqs]

    def _row_features(self, i: int, hidden: int) -> torch.Tensor:
        """Features F [m, H] of row i's m pending tokens (its last m): F_j = f_{j-1}, F_0 = 0."""
        m, rows, have, chunks = len(self.pending[i]), [], 0, self.feats[i]
        for chunk in reversed(chunks):
            rows.append(chunk[max(0, chunk.shape[0] - (m - have)):])
            have += rows[-1].shape[0]
            if have >= m:
                break
        if have < m:  # the pending tokens include x_0, which no feature precedes
            ref = chunks[0] if chunks else None
            rows.append(torch.zeros(m - have, hidden) if ref is None else ref.new_zeros(m - have, hidden))
        return torch.cat(rows[::-1]) if len(rows) > 1 else rows[0]

    def _project(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [..., feature_dim] (as the verify returns them) -> the head's input [..., H]."""
        project = getattr(self.drafter, "project_features", None)
        return feats if project is None else project(feats)

    def draft_model(self, k: int, u: torch.Tensor | None, params: BatchParams, alternatives: int = 0,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = max(len(p) for p in self.pending)
        h = int(getattr(self.drafter, "feature_dim", self.drafter.config.hidden_size))
        raw = torch.zeros(len(self.pending), m, h, dtype=self.drafter.dtype, device=self.device)  # [B, M, feature_dim]
        for i in range(len(self.pending)):
            r = self._row_features(i, h)
            raw[i, m - r.shape[0]:] = r
        self._feats = self._project(raw)  # [B, M, H]
        return super().draft_model(k, u, params, alternatives)

    def _forward(self, ids: torch.Tensor | None, first: bool) -> torch.Tensor:
        """Later drafts read the head's own predicted feature of the previous position."""
        fn = self.drafter.with_features(self._feats)
        logits, self._feats = self.dkv.forward_rows(self.pending, fn) if first else self.dkv.forward(ids, fn)
        return logits  # [B, V_draft]; _feats [B, 1, H]

    def _keeps(self, draft: Draft, n: list[int], k: int) -> list[int]:
        return [0] * len(n)

    def observe(self, draft: Draft, n: list[int], emitted: list[list[int]], feats: torch.Tensor | None) -> None:
        super().observe(draft, n, emitted, feats)
        for i, e in enumerate(emitted):
            self.feats[i].append(feats[i, : len(e)].clone())  # [n_i + 1, H]
