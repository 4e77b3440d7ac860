"""The `eagle` head of the embedded pair: distilled offline from the target states the build already
caches (the final normed hidden states are exactly the features the head reads), then scored.

Per window x_0..x_T with target features f_0..f_{T-1}: the head reads (x_j, f_{j-1}) and is trained
toward the target's next-token distribution head(f_j) over the draft vocabulary (KL) and toward f_j
itself (smooth L1, EAGLE's regression: later drafts of a step feed the head its own predicted f).
No extra target pass is needed. `pretrained_build.add_kinds` adds the head to a pair built before it existed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dvi.drafters.eagle import EagleDrafter, features_from_hidden
from trainers.builds.build_common import log, schedule
from trainers.builds.eagle_ttt import EagleObjective, ttt_loss
from trainers.builds.offline import TrainSchedule, lr_factor, optimizer_step
from trainers.builds.subset_distill import progress_bar, subset_kl, train_autocast, window_batches

if TYPE_CHECKING:
    from dvi.models.embedded import EmbeddedPaths, PretrainedPreset

__all__ = ["EagleData", "EagleObjective", "build_eagle", "distill_eagle", "eagle_agreement", "eagle_scores", "eagle_step_ms", "evaluate_eagle",
           "train_eagle"]


@dataclass(frozen=True)
class EagleData:
    """What a head trains on: `windows` [N, T + 1] token ids, `final` [N, T, H] the target's final normed hidden
    states on windows[:, :-1] (the teacher, and a first-recipe head's input), `layers` [N, T, len * H] the residual
    streams a fused head reads (None where the head reads `final`)."""

    windows: torch.Tensor
    final: torch.Tensor
    layers: torch.Tensor | None = None




def _eagle_loss(d: EagleDrafter, x: torch.Tensor, f: torch.Tensor, head: torch.Tensor,
                objective: EagleObjective) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T] inputs, f [B, T, H] the target's features of them, head [n, H] the target's head rows of the
    draft vocabulary; returns (KL + weighted feature loss, feature loss). `chained` adds a second pass whose
    inputs carry the head's own predicted features (what drafts 2..K of a step read): measured on held-out code
    it lifts chained agreement 0.122 -> 0.193."""
    t_logits = F.linear(f, head)  # [B, T, n]: the target's own next-token logits
    feats, loss, feat = features_from_hidden(f), 0.0, None
    for _ in range(2 if objective.chained else 1):
        with train_autocast():
            pred = d.model(input_ids=x, features=feats, with_logits=False).features  # [B, T, H]
            s_logits = F.linear(pred, head)  # [B, T, n]
        f_loss = F.smooth_l1_loss(pred.float(), f.float())
        loss = loss + subset_kl(s_logits, t_logits) + objective.feature_weight * f_loss
        feat = f_loss if feat is None else feat
        feats = features_from_hidden(pred)
    return loss, feat


def _window_loss(d: EagleDrafter, x: torch.Tensor, final: torch.Tensor, layers: torch.Tensor | None,
                 head: torch.Tensor, objective: EagleObjective, g: torch.Generator) -> tuple[torch.Tensor, float]:
    """One batch's loss under `objective`; (loss, the term logged beside it: feature loss or last-step KL)."""
    if not objective.ttt_steps:
        loss, feat = _eagle_loss(d, x, final, head.to(final.dtype), objective)
        return loss, float(feat.detach())
    fused = d.model.fuse is not None
    src = layers if fused else final
    with train_autocast():
        own = replace(objective, feature_weight=0.0) if fused else objective  # no final state to regress onto
        loss, per_step = ttt_loss(d.model, x, features_from_hidden(src.float()), final, head, own, generator=g)
    return loss, per_step[-1]


def distill_eagle(d: EagleDrafter, data: EagleData, vocab_ids: torch.Tensor, sched: TrainSchedule, batch: int = 8,
                  objective: EagleObjective = EagleObjective(), seed: int = 0,
                  on_tokens: Callable[[int], None] | None = None) -> dict:
    """Train `d`'s own weights (fc, layers, norm, fuse) for `sched.steps` steps on `data`, vocab_ids [n] the draft
    vocabulary. `on_tokens(tokens)` is called after every step (learning curves evaluate from it)."""
    windows, states, layers = data.windows, data.final, data.layers
    if d.model.fuse is not None and layers is None:
        raise ValueError("a head on fused target layers needs their states (`layers`)")
    steps, lr, warmup, min_lr_ratio, progress = sched.steps, sched.lr, sched.warmup, sched.min_lr_ratio, sched.progress
    head = d.model.lm_head.weight.detach()[vocab_ids].float()  # [n, H]: the target's head rows (frozen, shared)
    params = d.trainable_parameters()
    for prm in params:
        prm.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed + 7)
    losses, side, tokens = [], [], 0
    d.model.train()
    t0 = time.perf_counter()
    bar = progress_bar(steps, sched.desc, progress)
    try:
        for step, idx in window_batches(windows.shape[0], batch, steps, seed):
            for gr in opt.param_groups:
                gr["lr"] = lr * lr_factor(step, steps, warmup, min_lr_ratio)
            loss, extra = _window_loss(d, windows[idx, :-1], states[idx].float(),
                                       None if layers is None else layers[idx], head, objective, g)
            losses.append(optimizer_step(params, opt, loss, sched.grad_clip))
            side.append(extra)
            tokens += idx.numel() * (windows.shape[1] - 1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}", refresh=False)
            bar.update(1)
            if on_tokens is not None:
                d.model.eval()
                on_tokens(tokens)
                d.model.train()
    finally:
        bar.close()
        d.model.eval()
    wall = time.perf_counter() - t0
    n = max(1, len(losses) // 10)
    return {"steps": steps, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / max(wall, 1e-9),
            "first_loss": losses[0], "final_loss": sum(losses[-n:]) / n, "final_side_loss": sum(side[-n:]) / n,
            "feature_weight": objective.feature_weight, "chained": objective.chained,
            "ttt_steps": objective.ttt_steps, "sample": objective.sample}


def eagle_scores(target, d: EagleDrafter, windows: list[list[int]], vocab_ids: torch.Tensor,
                 skip: list[int] | None = None, k: int = 0) -> dict:
    """Top-1 agreement of the head's first draft (true features of every input, as the engine's first draft of a
    step) over the draft vocabulary `vocab_ids` with the target's greedy token, after `skip[i]` positions of each
    window; with `k`, also the chained acceptance of K = k drafts a step (`trainers.builds.eagle_eval.chain_acceptance`:
    meaningful where the windows are the target's greedy text, e.g. its chat replies)."""
    from trainers.builds.eagle_eval import chain_acceptance
    from trainers.builds.target_features import target_states

    st = target_states(target, windows, d.feature_layers or ())
    hidden = st.layers if d.feature_layers else st.final
    starts = [max(0, s) for s in skip] if skip else [0] * len(windows)
    res = chain_acceptance(d.model, windows, starts, hidden, st.top, vocab_ids.to(hidden.device), k=max(1, k))
    out = {"agreement": res["agreement"]}
    if k:
        out.update(accept_length=res["accept_length"], acceptance=res["acceptance"])
    return out


def eagle_agreement(target, d: EagleDrafter, windows: list[list[int]], vocab_ids: torch.Tensor,
                    skip: list[int] | None = None, batch: int = 8) -> float:
    """`eagle_scores`' first-draft agreement alone."""
    return eagle_scores(target, d, windows, vocab_ids, skip)["agreement"]


@torch.inference_mode()
def eagle_step_ms(d: EagleDrafter, steps: int = 48, context: int = 128) -> float:
    """Batch-1 KV-cached draft step of the head (ms, median, one thread), as the engine runs it."""
    import statistics

    from dvi.decode.kv import RaggedKV

    h = int(d.config.hidden_size)
    kv = RaggedKV(d.config, 1, "cpu", d.dtype)
    ids = torch.randint(0, d.vocab_size, (1, context))
    out = kv.forward(d.with_features(torch.zeros(1, context, h, dtype=d.dtype)), ids, logits_to_keep=1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits, f = kv.forward(d.with_features(out[1][:, -1:]), ids[:, -1:], logits_to_keep=1)
        logits.argmax(-1).tolist()
        times.append(time.perf_counter() - t0)
        out = (logits, f)
    return statistics.median(times) * 1e3


@dataclass(frozen=True)
class EagleRecipe:
    """A preset's eagle head: `fused` (EAGLE-3: the target's low / middle / high layers, `fused_layers`) or the final
    normed state; `ttt_steps` > 0 trains by the training-time test (else the first recipe's two passes, `chained`);
    `sample` the share of positions a TTT step's KL is taken at. Read from the preset's `eagle_*` fields (absent in
    presets older than them: the first recipe)."""

    tokens: int
    lr: float
    feature_weight: float = 1.0
    chained: bool = True
    fused: bool = False
    ttt_steps: int = 0
    sample: float = 1.0

    @classmethod
    def of(cls, p) -> EagleRecipe:
        return cls(tokens=p.eagle_tokens, lr=p.eagle_lr, feature_weight=p.eagle_feature_weight,
                   chained=p.eagle_chained, fused=bool(getattr(p, "eagle_fused", False)),
                   ttt_steps=int(getattr(p, "eagle_ttt_steps", 0)), sample=float(getattr(p, "eagle_sample", 1.0)))

    def objective(self) -> EagleObjective:
        return EagleObjective(feature_weight=self.feature_weight, chained=self.chained, ttt_steps=self.ttt_steps,
                              sample=self.sample)


def fused_layers(num_layers: int) -> tuple[int, ...] | None:
    """EAGLE-3's low, middle and high target layers for a target of `num_layers` (SmolLM2's 30: 2, 15, 28); None
    where fewer than two distinct layers exist."""
    layers = tuple(sorted({min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 2)}))
    return layers if len(layers) >= 2 else None


def recipe_feature_layers(p, num_layers: int) -> tuple[int, ...] | None:
    """The target layers the preset's eagle head reads (None: the final normed state)."""
    return fused_layers(num_layers) if EagleRecipe.of(p).fused else None


def train_eagle(p, target_path, data: EagleData, order: torch.Tensor, seed: int,
                progress: bool) -> tuple[EagleDrafter, dict]:
    """The preset's eagle head (`EagleRecipe`) on an fp32 copy of the target (bf16 autocast where native), trained
    for `p.eagle_tokens` token-passes over the first `p.train_vocab` draft ids; `layers` the residual streams of
    `recipe_feature_layers` on the windows (a fused head's input)."""
    from dvi.models.loading import load_causal_lm

    recipe = EagleRecipe.of(p)
    base = load_causal_lm(target_path, "cpu", "float32")
    for prm in base.parameters():
        prm.requires_grad_(False)
    torch.manual_seed(seed + 3)
    d = EagleDrafter(base, feature_layers=recipe_feature_layers(p, int(base.config.num_hidden_layers)))
    sched = schedule(p, recipe.tokens, f"eagle head[{p.name}]", progress, lr=recipe.lr)
    if d.model.fuse is None:
        data = replace(data, layers=None)
    stats = distill_eagle(d, data, order[: p.train_vocab], sched, batch=p.distill_batch,
                          objective=recipe.objective(), seed=seed)
    stats["feature_layers"] = list(d.feature_layers) if d.feature_layers else None
    return d, stats


def build_eagle(p: PretrainedPreset, paths: EmbeddedPaths, target, data: EagleData, order: torch.Tensor, seed: int,
                progress: bool) -> tuple:
    """Train the eagle head (`trainers.builds.eagle_build`) and save it to `paths.eagle` with its draft vocabulary;
    returns the head as served (reloaded on the bf16 target) and its training stats."""
    from dvi.drafters.vocab import save_draft_vocab
    from dvi.fsutil import replace_dir, tmp_dir_beside

    d, stats = train_eagle(p, paths.target, data, order, seed, progress)
    tmp = tmp_dir_beside(paths.eagle)  # whole or absent: a server may be loading the previous head
    d.save(tmp)
    if p.draft_vocab:
        save_draft_vocab(tmp, order[: p.draft_vocab], int(target.config.vocab_size))
    replace_dir(tmp, paths.eagle)
    return EagleDrafter.load(target, paths.eagle), stats


def evaluate_eagle(p: PretrainedPreset, target, served, order: torch.Tensor, heldout: tuple[dict, dict],
                   stats: dict, progress: bool) -> dict:
    """The served head's first-draft agreement per held-out domain (the `heldout_sets` the drafter is scored
    on) and its step latency, with its training stats: the manifest's `eagle` entry."""
    from dvi.drafters.vocab import apply_draft_vocab

    evals, skips = heldout
    n = p.serve_draft_vocab or p.draft_vocab
    vocab = order[:n] if n else torch.arange(served.vocab_size)
    # chat windows are the target's greedy replies: chained acceptance (K = 4) is exact there
    scores = {dom: eagle_scores(target, served, w, vocab, skip=skips.get(dom), k=4 if dom == "chat" else 0)
              for dom, w in evals.items()}
    agree = {dom: v["agreement"] for dom, v in scores.items()}
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        apply_draft_vocab(served.model, order[:n])
        ms = eagle_step_ms(served, p.latency_steps)
    finally:
        torch.set_num_threads(prev)
    log(f"eagle head: {stats['tokens']:,} tokens, loss {stats['first_loss']:.3f} -> {stats['final_loss']:.3f} "
         f"({stats['tokens_per_s']:.0f} tok/s); first-draft agreement "
         + ", ".join(f"{k} {v:.3f}" for k, v in agree.items()) + f" at {n} ids; chat accepted length (K=4) "
         f"{scores.get('chat', {}).get('accept_length', float('nan')):.2f}; step {ms:.2f} ms", progress)
    return {"train": stats, "agreement": agree, "draft_vocab": n, "step_ms": ms,
            "chat_accept_length_k4": scores.get("chat", {}).get("accept_length"),
            "chat_acceptance_k4": scores.get("chat", {}).get("acceptance")}
