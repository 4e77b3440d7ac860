"""Reduced draft vocabulary (FR-Spec / EAGLE-3 style): a drafter predicts over N target token ids.

The drafter's LM head is computed over the N subset rows only (the full head dominates a small
drafter's step: 49k x 576 for SmolLM2), and the logits the engine sees are full-vocabulary with
-inf outside the subset. So q = 0 outside the subset and greedy / rejection sampling are unchanged
in law: lossless by construction, nothing downstream needs to know.

How it is wired: `apply_draft_vocab(model, ids)` swaps the model's output embedding for a
`SubsetHead` that shares the full head's Parameter (state_dict keys, weight tying and
`save_pretrained` stay those of a normal full-vocab HF model) and holds a cached row slice of it.
Any drafter kind whose logits come out of an HF-style output embedding gets the reduced head the
same way: `SeparateDrafter` (the drafter LM), `EarlyExitDrafter` (its shallow copy's lm_head, a row
slice of the target's), and a future `eagle` head (apply it to the head module it owns).

Storage: a drafter dir stays a plain HF model; beside it `draft_vocab.safetensors` holds one
tensor `token_ids` (int64 [M]) in *priority order*: the always-included ids (EOS, BOS, pad ...)
first, then by descending count on the training text (ties: smaller id first). Any prefix of it is
a valid smaller draft vocabulary, so one file serves N = 32k, 16k, 8k ...: `load_draft_vocab(path,
size)` takes the first `size` ids (None = all of them, 0 = no reduction) and returns them sorted.

Training (`trainers.losses`, `subset_mode`): the trainer asks the head for the [.., N] subset
logits directly and maps the target's logged top-k ids onto subset positions, so the loss never
sees -inf.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
_POSTPROCESSED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")

__all__ = [
    "DRAFT_VOCAB_FILE",
    "SubsetHead",
    "frequent_token_ids",
    "build_draft_vocab",
    "save_draft_vocab",
    "load_draft_vocab",
    "draft_vocab_path",
    "apply_draft_vocab",
    "find_subset_head",
    "subset_mode",
    "fit_vocab",
]


def frequent_token_ids(
    token_id_sequences: Iterable[Sequence[int] | torch.Tensor],
    n: int,
    always: Iterable[int] = (),
    vocab_size: int | None = None,
) -> torch.Tensor:
    """The `n` ids to keep, in priority order: `always` first, then by count (ties: smaller id).

    `vocab_size` (if given) lets never-seen ids fill up to `n`; without it only seen ids are ranked.
    Returns int64 [min(n, candidates)].
    """
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    always_l = list(dict.fromkeys(int(t) for t in always if t is not None))
    chunks = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in token_id_sequences]
    flat = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.long)
    size = int(vocab_size) if vocab_size is not None else int(max([*always_l, int(flat.max()) if flat.numel() else -1]) + 1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= size):
        raise ValueError(f"token ids must lie in [0, {size})")
    counts = torch.bincount(flat, minlength=size).double()  # [V]
    seen = counts > 0 if vocab_size is None else torch.ones(size, dtype=torch.bool)
    # stable sort by -count keeps ascending id order among ties
    order = torch.sort(-counts, stable=True).indices
    ranked = [int(i) for i in order[seen[order]].tolist()]
    head = [t for t in always_l if 0 <= t < size]
    if len(head) != len(always_l):
        raise ValueError(f"always ids {always_l} must lie in [0, {size})")
    taken = set(head)
    out = head + [t for t in ranked if t not in taken]
    return torch.tensor(out[:n], dtype=torch.long)


def build_draft_vocab(tokenizer, texts: Iterable[str], path: str | Path, vocab_size: int) -> torch.Tensor:
    """Count `texts` with `tokenizer`, write the full priority order (specials first) to `path`; returns it.

    The whole vocabulary is stored (never-seen ids last), so any N can be chosen at load time.
    """
    seqs = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    specials = [i for i in getattr(tokenizer, "all_special_ids", []) if i is not None and 0 <= i < vocab_size]
    ids = frequent_token_ids(seqs, vocab_size, always=specials, vocab_size=vocab_size)
    save_draft_vocab(path, ids, vocab_size)
    return ids


def draft_vocab_path(path: str | Path) -> Path:
    """`path` itself if it is a file, else `path / draft_vocab.safetensors`."""
    p = Path(path)
    return p / DRAFT_VOCAB_FILE if p.is_dir() or p.suffix != ".safetensors" else p


def save_draft_vocab(path: str | Path, token_ids: torch.Tensor | Sequence[int], vocab_size: int) -> Path:
    """Write `token_ids` (priority order, see module doc) to `path` (a drafter dir or a file)."""
    from safetensors.torch import save_file

    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1).contiguous()
    _check_ids(ids, vocab_size, str(path))
    out = draft_vocab_path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "vocab_size": str(int(vocab_size)), "order": "priority"}
    save_file({"token_ids": ids}, str(out), metadata=meta)
    return out


def _check_ids(ids: torch.Tensor, vocab_size: int | None, where: str) -> None:
    if ids.numel() == 0:
        raise ValueError(f"{where}: draft vocabulary is empty")
    if int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size):
        raise ValueError(f"{where}: draft vocabulary ids must lie in [0, {vocab_size})")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{where}: draft vocabulary has duplicate ids")


def load_draft_vocab(path: str | Path | None, size: int | None = None, vocab_size: int | None = None,
                     field: str = "models.draft_vocab_size") -> torch.Tensor | None:
    """The sorted ids of the draft vocabulary at `path` (a file or a dir holding one), or None for full.

    `size`: None = every id in the file (full when there is no file), 0 = full vocabulary,
    N = the first N ids of the stored priority order (an error without a file or if N > stored).
    """
    if size is not None and size < 0:
        raise ValueError(f"{field} must be >= 0 or null, got {size}")
    f = draft_vocab_path(path) if path is not None else None
    if size == 0:
        return None
    if f is None or not f.is_file():
        if size is None:
            return None
        raise ValueError(f"{field}={size} but there is no {DRAFT_VOCAB_FILE} at {path}")
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as fh:
        meta = fh.metadata() or {}
        ids = fh.get_tensor("token_ids").long().reshape(-1)
    stored_v = int(meta["vocab_size"]) if "vocab_size" in meta else None
    if vocab_size is not None and stored_v is not None and stored_v != vocab_size:
        raise ValueError(f"{f} was built for a {stored_v}-token vocabulary, the model has {vocab_size}")
    _check_ids(ids, vocab_size or stored_v, str(f))
    if size is not None:
        if size > ids.numel():
            raise ValueError(f"{field}={size} exceeds the {ids.numel()} ids stored in {f}")
        ids = ids[:size]
    return torch.sort(ids).values


class SubsetHead(nn.Module):
    """Output embedding over `token_ids` only; emits full-vocab logits with -inf elsewhere.

    `weight` (and `bias`) ARE the full head's Parameters, so the model's state_dict, weight tying
    and in-place weight updates (target updates for early-exit drafters, optimiser steps) see one
    tensor. The N-row slice used at inference is cached and re-taken whenever the full weight
    changes (its version counter / storage), so a stale slice is never used; with gradients on
    the weight it is gathered per call so they flow to the full matrix.
    """

    def __init__(self, full: nn.Module, token_ids: torch.Tensor, vocab_size: int | None = None):
        super().__init__()
        w = full.weight
        v = int(vocab_size if vocab_size is not None else w.shape[0])
        ids = torch.sort(torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)).values
        _check_ids(ids, v, "draft vocabulary")
        self.weight = w
        self.bias = full.bias if getattr(full, "bias", None) is not None else None
        self.in_features, self.out_features = int(w.shape[1]), v
        index = torch.full((v,), -1, dtype=torch.long)
        index[ids] = torch.arange(ids.numel())
        self.register_buffer("token_ids", ids.to(w.device), persistent=False)  # [N]
        self.register_buffer("index", index.to(w.device), persistent=False)  # [V]: subset position or -1
        self.subset_only = False  # trainer: return the [.., N] subset logits (see `subset_mode`)
        self._cache: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._key: tuple | None = None

    @property
    def num_ids(self) -> int:
        return int(self.token_ids.numel())

    def _key_of(self, t: torch.Tensor) -> tuple:
        try:
            ver = t._version
        except RuntimeError:  # inference tensors have no version counter
            ver = None
        return (ver, t.data_ptr(), t.dtype, t.device)

    def _rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        w, b = self.weight, self.bias
        if torch.is_grad_enabled() and (w.requires_grad or (b is not None and b.requires_grad)):
            return w.index_select(0, self.token_ids), (b.index_select(0, self.token_ids) if b is not None else None)
        key = (self._key_of(w), self._key_of(b) if b is not None else None, self.token_ids.device)
        if self._cache is None or self._key != key:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable in autograd later
                ws = w.detach().index_select(0, self.token_ids).contiguous()  # [N, H]
                bs = b.detach().index_select(0, self.token_ids) if b is not None else None  # [N]
            self._cache = (ws, bs)
            self._key = key
        return self._cache

    def subset_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The N rows (and bias) the head multiplies, [N, H] contiguous (what a packed copy is made from)."""
        return self._rows()

    def placed(self, sub: torch.Tensor) -> torch.Tensor:
        """Subset logits [.., N] as the head returns them: at their token ids of the full vocabulary, -inf elsewhere
        (as they are in `subset_only` mode)."""
        if self.subset_only:
            return sub
        out = sub.new_full((*sub.shape[:-1], self.out_features), float("-inf"))  # [B, T, V]
        return out.index_copy(-1, self.token_ids, sub)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self._rows()
        return self.placed(F.linear(x, w, b))  # [B, T, N] -> [B, T, V]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, draft_ids={self.num_ids}"


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def apply_draft_vocab(model: nn.Module, token_ids: torch.Tensor | Sequence[int] | None) -> nn.Module:
    """Give `model` (an HF causal LM or peft model) a `SubsetHead` over `token_ids`, in place.

    None restores the full head. Returns `model`. Must run before a `model_forward` of it is built.
    """
    base = _base(model)
    head = base.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(base).__name__} has no output embedding to reduce")
    if isinstance(head, SubsetHead):
        full = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
        full.weight = head.weight
        if head.bias is not None:
            full.bias = head.bias
        head = full
    if token_ids is None:
        base.set_output_embeddings(head)
        return model
    cfg = getattr(base, "config", None)
    bad = [k for k in _POSTPROCESSED_LOGITS if getattr(cfg, k, None) not in (None, 1, 1.0)]
    if bad:
        raise ValueError(f"{type(base).__name__} post-processes its logits ({bad[0]}); a reduced draft "
                         "vocabulary needs plain lm_head logits")
    base.set_output_embeddings(SubsetHead(head, torch.as_tensor(token_ids), int(head.weight.shape[0])))
    return model


def find_subset_head(module: nn.Module) -> SubsetHead | None:
    """The `SubsetHead` inside `module` (peft / DDP wrappers included), or None."""
    return next((m for m in module.modules() if isinstance(m, SubsetHead)), None)


@contextlib.contextmanager
def subset_mode(module: nn.Module) -> Iterator[SubsetHead | None]:
    """Within the block, `module`'s SubsetHead returns the [.., N] subset logits (for the trainer's loss)."""
    head = find_subset_head(module)
    if head is None:
        yield None
        return
    prev, head.subset_only = head.subset_only, True
    try:
        yield head
    finally:
        head.subset_only = prev


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., V_head] logits as [..., V]: extra head rows (padding to a multiple) cut, a smaller head
    padded with -inf (a drafter whose vocabulary ends before the target's)."""
    v = logits.shape[-1]
    if v == vocab_size:
        return logits
    if v > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - v), float("-inf"))
    return torch.cat([logits, pad], -1)


def describe(path: str | Path) -> dict:
    """Size and metadata of a stored draft vocabulary (for manifests and logs)."""
    from safetensors import safe_open

    with safe_open(str(draft_vocab_path(path)), framework="pt") as fh:
        meta = fh.metadata() or {}
        n = int(fh.get_slice("token_ids").get_shape()[0])
    return {"stored_ids": n, **json.loads(json.dumps(meta))}
