"""Offline acceptance estimates from logged feedback, without running the target.

The feedback log carries, for every generated position, the target's token and its top-k
log-probs. That is enough to score a candidate drafter offline: run the drafter teacher-forced
over prompt + generated tokens and ask how often it would have been accepted.

* greedy traffic (temperature 0): a greedy draft is accepted iff the drafter's argmax equals
  the target's token, so α̂ = mean(argmax q == token).
* sampled traffic: rejection sampling accepts with probability Σ_x min(p(x), q(x)); with p known
  only on the target's top-k (renormalised there), the sum runs over those k ids; it is exact
  when the top-k hold nearly all the mass (k = 32 does on the embedded models).

Both the trainer (the manifest's held-out α) and the server (shadow check before promotion)
use this, so a promotion decision and its reported estimate always agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dvi.sampling import GREEDY_BELOW_TEMPERATURE

SHADOW_MAX_POSITIONS = 4096
"""Generated positions one shadow estimate reads at most: the trainer's held-out check before a
publish and the server's check before a promotion use the same cap, so they estimate alike."""

LogitsFn = Callable[..., torch.Tensor]
"""Maps input ids ``[1, L]`` (and, for an eagle head, its input features ``[1, L, H]``) to logits
``[1, L, V]`` (teacher forcing, no cache). ``fn.needs_features`` marks the eagle kind."""


@dataclass
class ShadowEstimate:
    alpha: float
    positions: int
    records: int


def shadow_passes(new_alpha: float, old_alpha: float, margin: float) -> bool:
    """Whether a candidate with shadow α `new_alpha` may replace one with `old_alpha`.

    A NaN/inf candidate estimate never passes (``not (nan < x)`` is True, which once promoted a
    worse drafter); a candidate is compared only with a finite live estimate.
    """
    if not math.isfinite(new_alpha):
        return False
    return not math.isfinite(old_alpha) or new_alpha >= old_alpha - margin


def hf_logits_fn(model: torch.nn.Module) -> LogitsFn:
    """Teacher-forced logits of a Hugging Face causal LM (or any module returning ``.logits``)."""

    from dvi.eagle import EagleModel

    base = model.get_base_model() if hasattr(model, "get_base_model") else model

    def fn(ids: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        extra = {} if features is None else {"features": features}
        out = model(input_ids=ids, use_cache=False, **extra)
        return out.logits if hasattr(out, "logits") else out

    fn.needs_features = isinstance(base, EagleModel)
    return fn


def _record_features(record: Mapping[str, Any] | Any, device) -> torch.Tensor | None:
    """An eagle head's input features F [1, L - 1, H] from a record's logged target features, or None."""
    from dvi.eagle import features_from_hidden

    h = getattr(record, "hidden", None) if not isinstance(record, Mapping) else record.get("hidden")
    if h is None or (isinstance(h, (bytes, bytearray)) and not h):
        return None
    if isinstance(h, (bytes, bytearray)):
        dim = record["hidden_dim"] if isinstance(record, Mapping) else record.hidden_dim
        h = torch.frombuffer(bytearray(h), dtype=torch.float16).reshape(-1, int(dim))
    else:
        h = torch.from_numpy(np.array(h))  # a copy: logged arrays are read-only
    return features_from_hidden(h).unsqueeze(0).to(device)


def _get(record: Mapping[str, Any] | Any, name: str) -> Any:
    return record[name] if isinstance(record, Mapping) else getattr(record, name)


@torch.inference_mode()
def shadow_alpha(
    logits_fn: LogitsFn,
    records: Iterable[Mapping[str, Any] | Any],
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
) -> ShadowEstimate:
    """Estimated α of the drafter behind ``logits_fn`` on logged records.

    Every generated position counts (not only those that were drafted live), so the estimate
    does not depend on which K the live engine happened to use. An eagle head is scored on the
    records that carry the target's features (teacher-forced: true features at every input).
    """
    needs_features = bool(getattr(logits_fn, "needs_features", False))
    hits = 0.0
    total = 0
    n_records = 0
    for rec in records:
        prompt: Sequence[int] = list(_get(rec, "prompt_ids"))
        tokens: Sequence[int] = list(_get(rec, "token_ids"))
        if not prompt or not tokens:
            continue
        temperature = float(_get(rec, "temperature") or 0.0)
        if not temperature >= GREEDY_BELOW_TEMPERATURE:  # tiny (or NaN) temperatures were served greedy
            temperature = 0.0
        ids = torch.tensor([list(prompt) + list(tokens)[:-1]], device=device)
        if needs_features:
            feats = _record_features(rec, device)
            if feats is None:
                continue
            logits = logits_fn(ids, feats)[0, len(prompt) - 1 :].float()  # predicts tokens[0..]
        else:
            logits = logits_fn(ids)[0, len(prompt) - 1 :].float()
        n = len(tokens)
        if temperature <= 0.0:
            pred = logits.argmax(-1).cpu()
            hits += float((pred == torch.tensor(tokens)).sum())
        else:
            topk_ids = torch.tensor([list(x) for x in _get(rec, "topk_ids")], device=device)
            topk_lp = torch.tensor([list(x) for x in _get(rec, "topk_logprobs")], device=device)
            q = torch.softmax(logits / temperature, dim=-1)
            p = torch.softmax(topk_lp / temperature, dim=-1)  # target warped on its top-k
            hits += float(torch.minimum(p, q.gather(-1, topk_ids)).sum())
        total += n
        n_records += 1
        if max_positions is not None and total >= max_positions:
            break
    return ShadowEstimate(alpha=hits / total if total else float("nan"), positions=total, records=n_records)
