"""Feedback records to training batches: the held-out split, collation of compact records
(`FeedbackRecord.compact`: numpy arrays, the learned drafter's own drafts) into the loss's tensors.

Its own module because it is the one place that knows the tensor layout the loss expects
(`trainers.losses.dvi_loss`); the trainer only moves batches to the device and steps.

Shapes: B rows, W input width (prompt + generated tokens but the last, left-padded), T
generated positions trained on (the last T inputs of each row), k top-k entries per position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dvi.feedback import FeedbackRecord
from dvi.feedback.shadow import is_heldout

__all__ = ["Batch", "build_batch", "micro_batches", "is_heldout"]


@dataclass
class Batch:
    """Left-padded inputs; the last `T` positions of each row predict its generated tokens."""

    input_ids: torch.Tensor  # [B, W]
    attention_mask: torch.Tensor  # [B, W]
    position_ids: torch.Tensor  # [B, W]
    weights: torch.Tensor  # [B, T] per-position loss weights (0 = padding)
    topk_ids: torch.Tensor  # [B, T, k]
    topk_logprobs: torch.Tensor  # [B, T, k]
    drafted_ids: torch.Tensor  # [B, T]
    accepted: torch.Tensor  # [B, T]
    tokens: int  # generated positions trained on
    features: torch.Tensor | None = None  # [B, W, H] eagle inputs F_j = f_{j-1} (float16), zero on padding
    feature_targets: torch.Tensor | None = None  # [B, T, H] f_j, what the head predicts at input j

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Extra forward arguments of the drafter kind the batch was built for (eagle: its features)."""
        return {} if self.features is None else {"features": self.features}

    @property
    def width(self) -> int:
        return int(self.topk_ids.shape[1])

    def to(self, device: torch.device) -> Batch:
        return Batch(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})


def build_batch(
    records: Sequence[FeedbackRecord], weights: Sequence[float], pad_id: int = 0, max_seq_len: int = 512
) -> Batch | None:
    """Teacher-forced batch over prompt + generated tokens.

    Left padding (with explicit position ids) puts every row's generated positions at the end,
    so the model computes logits only there (`logits_to_keep`): the vocabulary projection is
    most of a small drafter's cost. Rows longer than `max_seq_len` lose their oldest tokens.
    """
    rows = [(r.compact(), float(w)) for r, w in zip(records, weights, strict=True) if len(r.token_ids) and w > 0]
    if not rows:
        return None
    seqs, keeps = [], []
    for e, _ in rows:
        seq = np.concatenate([e.prompt_ids, e.token_ids[:-1]])  # [p + n - 1]: input j predicts token j + 1
        n = len(e.token_ids)
        n_keep = min(n, max_seq_len)  # generated positions of this row that stay in the window
        seqs.append(seq[-max_seq_len:])  # [<= max_seq_len], oldest tokens dropped
        keeps.append(n_keep)
    b, w_len, t_len = len(rows), max(len(s) for s in seqs), max(keeps)  # B, W, T
    k = max(e.topk_ids.shape[1] for e, _ in rows)
    ids = torch.full((b, w_len), pad_id, dtype=torch.long)  # [B, W]
    attn = torch.zeros((b, w_len), dtype=torch.long)  # [B, W]
    weights_t = torch.zeros((b, t_len))  # [B, T]
    tk = torch.full((b, t_len, k), -1, dtype=torch.long)  # [B, T, k]
    tl = torch.full((b, t_len, k), float("-inf"))  # [B, T, k]
    dr = torch.full((b, t_len), -1, dtype=torch.long)  # [B, T]
    ac = torch.zeros((b, t_len), dtype=torch.bool)  # [B, T]
    for i, ((e, w), seq, nk) in enumerate(zip(rows, seqs, keeps, strict=True)):
        ids[i, w_len - len(seq):] = torch.from_numpy(seq)  # right-aligned: left padding
        attn[i, w_len - len(seq):] = 1
        n = len(e.token_ids)
        sl = slice(n - nk, n)  # the row's kept generated positions, in its own [n] arrays
        c = slice(t_len - nk, t_len)  # where they sit in the batch's last T columns
        weights_t[i, c] = w
        kk = e.topk_ids.shape[1]
        tk[i, c, :kk] = torch.from_numpy(e.topk_ids[sl])
        tl[i, c, :kk] = torch.from_numpy(e.topk_logprobs[sl].astype(np.float32))
        dr[i, c] = torch.from_numpy(e.drafted_ids[sl])
        ac[i, c] = torch.from_numpy(e.accepted[sl])
    pos = (attn.cumsum(-1) - 1).clamp_min(0)  # [B, W]: 0 at each row's first real token
    feats = _features([e for e, _ in rows], seqs, keeps, w_len, t_len)
    return Batch(ids, attn, pos, weights_t, tk, tl, dr, ac, tokens=int(sum(keeps)),
                 features=None if feats is None else feats[0], feature_targets=None if feats is None else feats[1])


def micro_batches(
    records: Sequence[FeedbackRecord], weights: Sequence[float], pad_id: int = 0, max_seq_len: int = 512,
    max_tokens: int = 0,
) -> list[Batch]:
    """A step's rows as passes of at most `max_tokens` padded inputs each (rows x width; a longer row passes alone),
    rows of like length together: what a step holds for its backward then no longer grows with the traffic's lengths
    (a long-prompt phase doubled the trainer's round memory). 0, or a step that fits: one pass, `build_batch`'s."""
    kept = [(r, float(w)) for r, w in zip(records, weights, strict=True) if len(r.token_ids) and w > 0]
    widths = [min(len(r.prompt_ids) + len(r.token_ids) - 1, max_seq_len) for r, _ in kept]
    if max_tokens <= 0 or len(kept) * max(widths, default=0) <= max_tokens:
        batch = build_batch(records, weights, pad_id, max_seq_len)
        return [] if batch is None else [batch]
    parts: list[list[int]] = []
    for i in sorted(range(len(kept)), key=lambda i: widths[i]):
        if parts and (len(parts[-1]) + 1) * widths[i] <= max_tokens:  # widths ascend: this row is the widest yet
            parts[-1].append(i)
        else:
            parts.append([i])
    out = [build_batch([kept[i][0] for i in p], [kept[i][1] for i in p], pad_id, max_seq_len) for p in parts]
    return [b for b in out if b is not None]


def _features(examples: Sequence[FeedbackRecord], seqs: Sequence[np.ndarray], keeps: Sequence[int], w_len: int,
              t_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Eagle inputs F [B, W, H] and targets f [B, T, H], aligned with `build_batch`'s left padding and
    truncation; None unless every row carries features (a batch trains one drafter kind)."""
    hidden = [e.features() for e in examples]  # [L - 1, H] each, or None
    if any(f is None for f in hidden):
        return None
    from dvi.drafters.eagle import features_from_hidden

    h = hidden[0].shape[1]
    feats = torch.zeros((len(examples), w_len, h), dtype=torch.float16)  # [B, W, H]
    targets = torch.zeros((len(examples), t_len, h), dtype=torch.float16)  # [B, T, H]
    for i, (e_hidden, seq, nk) in enumerate(zip(hidden, seqs, keeps, strict=True)):
        # f_j of input j, [L - 1, H] (row count checked when the record was built); only the rows this
        # batch keeps are copied (F_j = f_{j-1}, so one more than the inputs kept).
        f = torch.from_numpy(np.array(e_hidden[-(len(seq) + 1):]))
        feats[i, w_len - len(seq):] = features_from_hidden(f)[-len(seq):]
        targets[i, t_len - nk:] = f[-nk:]
    return feats, targets
