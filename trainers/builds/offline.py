"""Offline training loops: LM pretraining and full-vocab KL distillation, plus held-out evaluation.

Used by `trainers.builds.bootstrap` to build the embedded pair, and by the drift benchmark to build its
"ceiling" drafter (distilled on prose for a fixed wall-time budget, hence `max_seconds`).
Plain functions over plain batches of token ids; no framework.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from dvi.models.embedded import OPTIMIZERS

# ---------------------------------------------------------------------------------------------
# data


def pack_docs(docs_ids: Iterable[Sequence[int]], bos_id: int | None, eos_id: int | None) -> torch.Tensor:
    """Concatenate documents into one 1-D stream, each as [bos] + ids + [eos]."""
    parts = []
    for ids in docs_ids:
        row = ([bos_id] if bos_id is not None else []) + list(ids) + ([eos_id] if eos_id is not None else [])
        parts.append(torch.tensor(row, dtype=torch.long))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def token_batches(
    streams: Sequence[torch.Tensor],
    batch_size: int,
    seq_len: int,
    weights: Sequence[float] | None = None,
    seed: int = 0,
) -> Iterator[torch.Tensor]:
    """Endless (batch_size, seq_len + 1) windows cut at random offsets from packed token streams.

    Each row picks a stream with probability proportional to `weights` (default equal), so the
    domain mix is exact in expectation whatever the streams' sizes. Deterministic for a seed.
    """
    streams = [s for s in streams]
    for s in streams:
        if s.numel() < seq_len + 2:
            raise ValueError(f"a token stream has {s.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}")
    w = torch.tensor(weights if weights is not None else [1.0] * len(streams), dtype=torch.double)
    g = torch.Generator().manual_seed(seed)
    while True:
        which = torch.multinomial(w, batch_size, replacement=True, generator=g).tolist()
        rows = []
        for k in which:
            s = streams[k]
            off = int(torch.randint(0, s.numel() - seq_len - 1, (1,), generator=g))
            rows.append(s[off: off + seq_len + 1])
        yield torch.stack(rows)


@torch.no_grad()
def copy_layer(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """Copy decoder layer `src` into `dst` of the same width; a wider FFN in `dst` keeps its extra
    units' random gate/up weights with their down-projection at zero, so `dst` computes exactly `src`."""
    weights = src.state_dict()
    for name, w in dst.state_dict().items():
        v = weights[name]
        if w.shape == v.shape:
            w.copy_(v)
        elif name.endswith("down_proj.weight"):
            w.zero_()
            w[:, : v.shape[1]].copy_(v)
        else:  # gate_proj / up_proj: [intermediate, hidden]
            w[: v.shape[0]].copy_(v)


# ---------------------------------------------------------------------------------------------
# optimisation


def autocast_ctx(device_type: str, mixed_precision: bool):
    """bf16 autocast on `device_type` where it pays (CUDA, and CPUs with bf16 matmul units:
    measured 1.4-1.8x training tok/s on this Xeon); a no-op context otherwise. Losses stay fp32."""
    if not mixed_precision:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)


def maybe_compile(fn: Callable[..., object], enabled: bool) -> Callable[..., object]:
    """`fn` (a module or a whole loss function) through `torch.compile` for fixed-shape training
    batches when enabled. Compiling the loss with the forward fuses the norm/rotary/SiLU glue that
    dominates narrow models and the logits' cast + cross-entropy (measured on this CPU, 10x160
    target, batch 8: eager 3.0k tok/s, compiled model 4.2k, compiled model + loss 4.5k).
    Compilation happens at the first call; if it fails (no C++ toolchain, unsupported backend) a
    warning says why and training goes on eagerly with the same parameters."""
    if not enabled:
        return fn
    compiled = torch.compile(fn, dynamic=False)
    state = {"fn": compiled}

    def call(*args, **kwargs):
        if state["fn"] is compiled:
            try:
                return compiled(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - compile is an optimisation, never a requirement
                print(f"[train] torch.compile failed ({type(e).__name__}: {str(e)[:200]}); training eagerly",
                      file=sys.stderr, flush=True)
                state["fn"] = fn
        return state["fn"](*args, **kwargs)

    return call


def lr_factor(step: int, total: int, warmup: int, min_ratio: float = 0.1, progress: float | None = None) -> float:
    """Linear warmup then cosine decay to `min_ratio`; `progress` (0..1) overrides step/total."""
    if step < warmup:
        return (step + 1) / max(1, warmup)
    p = progress if progress is not None else (step - warmup) / max(1, total - warmup)
    p = min(1.0, max(0.0, p))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))


class _Optimizers:
    """Several optimizers stepped as one (Muon for hidden matrices, AdamW for the rest)."""

    def __init__(self, *opts: torch.optim.Optimizer):
        self.opts = opts
        self.param_groups = [g for o in opts for g in o.param_groups]

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def _adamw(groups: list[dict], lr: float, betas: tuple[float, float]) -> torch.optim.Optimizer:
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=lr, betas=betas)


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.1,
                   betas: tuple[float, float] = (0.9, 0.95), optimizer: str = "adamw",
                   muon_lr: float | None = None) -> torch.optim.Optimizer | _Optimizers:
    """AdamW with decay on matrices only (not norms/biases); fused kernel where supported.

    `optimizer="muon"`: the decoder layers' weight matrices go to Muon (orthogonalised momentum, which
    learns more per token than AdamW at a fixed budget) at `muon_lr` (default: `lr`, RMS-matched
    to AdamW); embeddings, LM head and norms stay on AdamW, as Muon is meant only for hidden
    matrices. Every param group keeps its peak LR as `initial_lr` for the schedule.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    seen, decay, no_decay, hidden = set(), [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dim() < 2:
            no_decay.append(p)
        elif optimizer == "muon" and ".layers." in f".{name}" and "embed" not in name:
            hidden.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt: torch.optim.Optimizer | _Optimizers = _adamw([g for g in groups if g["params"]], lr, betas)
    if hidden:
        muon = torch.optim.Muon(hidden, lr=muon_lr or lr, weight_decay=weight_decay,
                                adjust_lr_fn="match_rms_adamw")
        opt = _Optimizers(opt, muon)
    for g in opt.param_groups:
        g["initial_lr"] = g["lr"]
    return opt


@dataclass
class TrainSchedule:
    """How an offline loop trains: budget, LR schedule, optimizer, precision, progress bar.

    Either `steps` or `max_seconds` (or both) bounds the run; the LR (linear warmup, then cosine
    to `min_lr_ratio` x `lr`) follows whichever budget is further spent when `time_schedule`,
    else the step count only (a safety cap that leaves the run deterministic unless hit).
    `mixed_precision` (bf16 autocast) and `compile` trade bit-exactness across machines for 2-3x
    tokens per second. `optimizer` is one of `dvi.models.embedded.OPTIMIZERS` (Muon at `muon_lr`).
    """

    steps: int = 0
    lr: float = 1e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0
    max_seconds: float | None = None
    time_schedule: bool = True
    optimizer: str = "adamw"
    muon_lr: float | None = None
    mixed_precision: bool = False
    compile: bool = False
    progress: bool = True
    desc: str = "train"
    # measured along the way (trainers.builds.learning_curve): probe(model) -> {domain: agreement}, on a geometric grid of
    # steps; loops that take it return the points as their stats' `curve`
    probe: Callable[[torch.nn.Module], dict] | None = None


PRETRAIN_DEFAULTS = {"lr": 1e-3, "warmup": 20, "weight_decay": 0.1, "desc": "pretrain"}
DISTILL_DEFAULTS = {"lr": 3e-3, "warmup": 10, "weight_decay": 0.0, "desc": "distill"}


def _schedule(schedule: TrainSchedule | None, defaults: dict[str, Any], options: dict[str, Any]) -> TrainSchedule:
    """`schedule` with `options` (TrainSchedule fields) applied; built from `defaults` when None."""
    if schedule is None:
        return TrainSchedule(**{**defaults, **options})
    return dataclasses.replace(schedule, **options)


class _Clock:
    """Wall time against the budget, and the LR factor of each step (see `TrainSchedule`)."""

    def __init__(self, s: TrainSchedule) -> None:
        self.s = s
        self.total = s.steps if s.steps > 0 else 10**9
        self.t0 = time.perf_counter()
        self.time_bound = False  # the wall budget, not the step count, drove the schedule at some step

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def out_of_time(self, elapsed: float) -> bool:
        return self.s.max_seconds is not None and elapsed >= self.s.max_seconds

    def lr_factor(self, step: int, elapsed: float) -> float:
        """The schedule follows whichever budget (steps or seconds) is further spent."""
        s, prog = self.s, None
        if s.max_seconds and s.time_schedule:
            time_prog = elapsed / s.max_seconds
            step_prog = (step - s.warmup) / max(1, self.total - s.warmup) if s.steps > 0 else 0.0
            prog = max(time_prog, step_prog)
            self.time_bound = self.time_bound or (step >= s.warmup and time_prog > step_prog)
        return lr_factor(step, self.total, s.warmup, s.min_lr_ratio, prog)


class _RunLog:
    """Losses, tokens and the progress bar of one training run."""

    def __init__(self, s: TrainSchedule, clock: _Clock) -> None:
        self.clock = clock
        self.tokens, self.losses, self.step, self.ema = 0, [], 0, None
        self.bar = tqdm(total=s.steps if s.steps > 0 else None, desc=s.desc, disable=not s.progress, unit="step",
                        dynamic_ncols=True, leave=False, mininterval=0.5 if sys.stderr.isatty() else 10.0)

    def record(self, loss: float, batch: torch.Tensor) -> None:
        self.losses.append(loss)
        self.ema = loss if self.ema is None else 0.95 * self.ema + 0.05 * loss
        self.tokens += batch.shape[0] * (batch.shape[1] - 1)
        self.step += 1
        self.bar.set_postfix(loss=f"{self.ema:.3f}", tok_s=f"{self.tokens / max(1e-9, self.clock.elapsed()):.0f}",
                             refresh=False)
        self.bar.update(1)

    def summary(self, steps: int) -> dict:
        wall = self.clock.elapsed()
        losses = self.losses
        tail = losses[-max(1, len(losses) // 10):] if losses else [float("nan")]
        return {"steps": self.step, "tokens": self.tokens, "wall_s": wall,
                "tokens_per_s": self.tokens / max(wall, 1e-9), "final_loss": sum(tail) / len(tail),
                "first_loss": losses[0] if losses else float("nan"),
                "time_bound": self.clock.time_bound or (steps > 0 and self.step < steps)}


def optimizer_step(params: Iterable[torch.nn.Parameter], opt: Any, loss: torch.Tensor,
                   grad_clip: float | None) -> float:
    """One step of every offline loop: backward, clip `params` (if `grad_clip`), step, zero; the loss value."""
    loss.backward()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _train_loop(model: torch.nn.Module, loss_fn: Callable[[torch.Tensor], torch.Tensor],
                batches: Iterable[torch.Tensor], s: TrainSchedule) -> dict:
    """Train until `s.steps` or `s.max_seconds` runs out; returns steps/tokens/loss/wall stats."""
    if s.steps <= 0 and not s.max_seconds:
        raise ValueError("need steps > 0 or a max_seconds budget")
    opt = make_optimizer(model, s.lr, s.weight_decay, optimizer=s.optimizer, muon_lr=s.muon_lr)
    model.train()
    it = iter(batches)
    clock = _Clock(s)
    run = _RunLog(s, clock)
    try:
        while run.step < clock.total:
            elapsed = clock.elapsed()
            if clock.out_of_time(elapsed):
                break
            f = clock.lr_factor(run.step, elapsed)
            for gr in opt.param_groups:
                gr["lr"] = gr["initial_lr"] * f
            batch = next(it)
            run.record(optimizer_step(model.parameters(), opt, loss_fn(batch), s.grad_clip), batch)
    finally:
        run.bar.close()
        model.eval()
    return run.summary(s.steps)


def pretrain_lm(model: torch.nn.Module, batches: Iterable[torch.Tensor], steps: int = 0,
                schedule: TrainSchedule | None = None, **options: Any) -> dict:
    """Next-token cross-entropy training on (B, T+1) id batches; returns steps/tokens/loss/wall stats.

    `schedule` (a `TrainSchedule`; `PRETRAIN_DEFAULTS` when None) says how; `options` are
    `TrainSchedule` fields that override it (``lr=1e-2, max_seconds=60, ...``). A positive `steps`
    sets the step budget.
    """
    s = _schedule(schedule, PRETRAIN_DEFAULTS, {**options, **({"steps": steps} if steps else {})})
    dev = next(model.parameters()).device.type

    def lm_loss(batch: torch.Tensor) -> torch.Tensor:
        with autocast_ctx(dev, s.mixed_precision):
            logits = model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))

    return _train_loop(model, maybe_compile(lm_loss, s.compile), batches, s)


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of KL(teacher || student) over the full vocabulary (x T^2, as usual)."""
    v = student_logits.shape[-1]
    s = F.log_softmax(student_logits.reshape(-1, v).float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.reshape(-1, v).float() / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


def distill(student: torch.nn.Module, teacher: torch.nn.Module, batches: Iterable[torch.Tensor], steps: int = 0,
            temperature: float = 1.0, ce_weight: float = 0.0, schedule: TrainSchedule | None = None,
            **options: Any) -> dict:
    """Train `student` toward `teacher`'s full next-token distribution: KL(teacher || student).

    `ce_weight` > 0 mixes in the plain next-token loss. `schedule` / `options` / `steps` as in
    `pretrain_lm` (defaults `DISTILL_DEFAULTS`).
    """
    s = _schedule(schedule, DISTILL_DEFAULTS, {**options, **({"steps": steps} if steps else {})})
    teacher.eval()
    dev = next(student.parameters()).device.type

    def teacher_logits(x: torch.Tensor) -> torch.Tensor:
        with autocast_ctx(dev, s.mixed_precision):
            return teacher(input_ids=x).logits.float()

    def student_loss(batch: torch.Tensor, t_logits: torch.Tensor) -> torch.Tensor:
        with autocast_ctx(dev, s.mixed_precision):
            s_logits = student(input_ids=batch[:, :-1]).logits
        loss = kl_loss(s_logits, t_logits, temperature)
        if ce_weight:
            loss = loss + ce_weight * F.cross_entropy(
                s_logits.reshape(-1, s_logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        return loss

    t_fwd, s_loss = maybe_compile(teacher_logits, s.compile), maybe_compile(student_loss, s.compile)

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t_logits = t_fwd(batch[:, :-1])
        return s_loss(batch, t_logits)

    return _train_loop(student, loss_fn, batches, s)


# ---------------------------------------------------------------------------------------------
# evaluation


def _eval_windows(docs_ids: Sequence[Sequence[int]], bos_id: int | None, seq_len: int,
                  stride: int | None = None) -> list[tuple[torch.Tensor, int]]:
    """(window, skip) pairs covering each doc so every token is scored exactly once.

    Windows hold <= seq_len + 1 tokens and start every `stride` tokens (default seq_len: disjoint);
    a later window re-reads the previous seq_len - stride tokens as context and scores only the
    targets after its first `skip`, so every scored token sees >= seq_len - stride tokens of context
    (the usual sliding-window perplexity, instead of restarting from nothing at each boundary).
    """
    stride = seq_len if stride is None else stride
    if not 0 < stride <= seq_len:
        raise ValueError(f"stride must be in 1..seq_len={seq_len}, got {stride}")
    out = []
    for ids in docs_ids:
        row = ([bos_id] if bos_id is not None else []) + list(ids)
        n_targets = len(row) - 1
        scored = 0
        start = 0
        while scored < n_targets:
            win = row[start: start + seq_len + 1]
            out.append((torch.tensor(win, dtype=torch.long), scored - start))
            scored = start + len(win) - 1
            start += stride
    return out


@dataclass
class EvalOptions:
    """How `evaluate_lms` batches and scores: rows per forward pass, the pad id, the model whose
    argmax the others' top-1 agreement is measured against (None: no agreement), the window stride."""

    batch_size: int = 16
    pad_id: int = 0
    agree_with: str | None = None
    stride: int | None = None


def _window_batch(chunk: Sequence[tuple[torch.Tensor, int]], pad_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, L], attention mask [B, L], and the scored targets [B, L-1] of some windows."""
    L = max(len(w) for w, _ in chunk)
    ids = torch.full((len(chunk), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(chunk), L), dtype=torch.long)
    valid = torch.zeros((len(chunk), L - 1), dtype=torch.bool)
    for r, (w, skip) in enumerate(chunk):
        ids[r, : len(w)] = w
        mask[r, : len(w)] = 1
        valid[r, skip: len(w) - 1] = True
    return ids, mask, valid


@torch.inference_mode()
def evaluate_lms(models: dict[str, torch.nn.Module], docs_ids: Sequence[Sequence[int]], chars: int,
                 bos_id: int | None, seq_len: int = 256, **options: Any) -> dict:
    """Held-out loss of each model on the same documents: mean NLL/token, bits/char, and (optionally)
    top-1 agreement of every model's argmax with the model named `agree_with`.

    bits/char = summed token NLL / `chars` / ln 2, with `chars` the documents' total characters, so
    tokenizers of different granularity compare fairly. `stride` < seq_len scores with sliding
    windows (see `_eval_windows`). `options`: `EvalOptions` fields (batch_size, pad_id, agree_with, stride).
    """
    o = EvalOptions(**options)
    wins = sorted(_eval_windows(docs_ids, bos_id, seq_len, o.stride), key=lambda w: len(w[0]))
    nll = {k: 0.0 for k in models}
    agree = {k: 0 for k in models}
    n_tok = 0
    for i in range(0, len(wins), o.batch_size):
        ids, mask, valid = _window_batch(wins[i: i + o.batch_size], o.pad_id)
        tgt = ids[:, 1:]
        n_tok += int(valid.sum())
        argmax = {}
        for name, m in models.items():
            dev = next(m.parameters()).device
            logits = m(input_ids=ids[:, :-1].to(dev), attention_mask=mask[:, :-1].to(dev)).logits.float().cpu()
            lp = F.log_softmax(logits, dim=-1)
            tok_nll = -lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
            nll[name] += float(tok_nll[valid].sum())
            argmax[name] = logits.argmax(-1)
        if o.agree_with is not None:
            for name in models:
                agree[name] += int(((argmax[name] == argmax[o.agree_with]) & valid).sum())
    out = {"tokens": n_tok, "chars": chars}
    for name in models:
        out[name] = {"loss": nll[name] / max(1, n_tok), "bits_per_char": nll[name] / max(1, chars) / math.log(2)}
        if o.agree_with is not None and name != o.agree_with:
            out[name]["top1_agreement"] = agree[name] / max(1, n_tok)
    return out


@torch.inference_mode()
def distinct_token_ratio(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                         pad_id: int | None = None) -> dict:
    """Greedy continuations of each prompt; mean share of distinct tokens (low = looping/degenerate)."""
    dev = next(model.parameters()).device
    ratios, samples = [], []
    for p in prompts:
        ids = torch.tensor([list(p)], dtype=torch.long, device=dev)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=None)
        new = out[0, ids.shape[1]:].tolist()
        ratios.append(len(set(new)) / max(1, len(new)))
        samples.append(new)
    return {"distinct_token_ratio": sum(ratios) / max(1, len(ratios)), "per_prompt": ratios, "samples": samples}
