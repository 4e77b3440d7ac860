"""Distillation over a draft vocabulary from cached teacher states (FR-Spec style), for real targets.

A 135M-parameter teacher's forward is the dominant cost of distilling a small drafter on this CPU,
and the full 49k-row heads of both models dominate what remains. So the teacher runs once over
the training windows and its final (normed) hidden states are kept in bf16 (1.1 KB a token); a
training step then rebuilds the teacher's logits over the draft vocabulary only (one small
matmul with its head rows) and trains the student's head rows of the same ids, for as many
epochs as the budget allows. The loss is KL(teacher || student) with both renormalised over the
draft vocabulary, which is the law the served drafter samples from.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from trainers.builds.offline import TrainSchedule, lr_factor, make_optimizer, optimizer_step


@torch.inference_mode()
def teacher_states(teacher, windows: torch.Tensor, batch: int = 8, progress: bool = False,
                   desc: str = "teacher states") -> torch.Tensor:
    """Final hidden states `[N, T, H]` (bf16) of `teacher` on `windows[:, :-1]` (`windows`: `[N, T + 1]`)."""
    out = []
    dtype = next(teacher.parameters()).dtype
    for i in tqdm(range(0, windows.shape[0], batch), desc=desc, disable=not progress, leave=False,
                  mininterval=0.5 if sys.stderr.isatty() else 10.0):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.float32):
            h = teacher.model(input_ids=windows[i: i + batch, :-1]).last_hidden_state
        out.append(h.to(torch.bfloat16))
    return torch.cat(out)


def train_autocast():
    """bf16 autocast where the CPU multiplies bf16 natively (AVX512-BF16 / AMX); elsewhere bf16 is emulated,
    several times slower than fp32 (measured on an AVX2 Zen3: the target labels 26 tok/s in bf16, 137 in fp32),
    so training stays fp32."""
    import contextlib

    from dvi.models.loading import cpu_has_native_bf16

    return torch.autocast("cpu", dtype=torch.bfloat16) if cpu_has_native_bf16() else contextlib.nullcontext()


def compute_dtype() -> torch.dtype:
    """The dtype `train_autocast` computes in."""
    from dvi.models.loading import cpu_has_native_bf16

    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def window_batches(n_windows: int, batch: int, steps: int, seed: int):
    """(step, window indices [batch]) for `steps` steps, drawn in seeded epochs reshuffled each pass."""
    g = torch.Generator().manual_seed(seed)
    order, pos = torch.randperm(n_windows, generator=g), 0
    for step in range(steps):
        if pos + batch > order.numel():
            order, pos = torch.randperm(n_windows, generator=g), 0
        yield step, order[pos: pos + batch]
        pos += batch


def progress_bar(steps: int, desc: str, progress: bool):
    """The offline loops' step bar (sparse updates when stderr is not a terminal)."""
    return tqdm(total=steps, desc=desc, disable=not progress, unit="step", leave=False,
                mininterval=0.5 if sys.stderr.isatty() else 10.0)


def subset_kl(s_logits: torch.Tensor, t_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student), both `[..., N]` over the same draft ids."""
    t_logp = F.log_softmax(t_logits.float(), -1)
    s_logp = F.log_softmax(s_logits.float(), -1)
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()


def distill_subset(student, teacher_head: torch.Tensor, windows: torch.Tensor, states: torch.Tensor,
                   vocab_ids: torch.Tensor, sched: TrainSchedule, batch: int = 8, seed: int = 0) -> dict:
    """Train `student` (an HF Llama-style causal LM) toward the teacher over `vocab_ids`.

    `teacher_head`: `[V, H]` the teacher's LM head; `windows`: `[N, T + 1]` token ids; `states`:
    `[N, T, H]` from `teacher_states`; `vocab_ids`: `[n]` the draft vocabulary. Windows are drawn
    in seeded epochs (reshuffled each pass) until `sched.steps` optimizer steps are done (`sched`'s
    lr, warmup, min_lr_ratio, grad_clip, progress and desc apply; weight decay is off). `sched.probe(student)` (in
    eval mode), when given, is taken on a geometric grid of steps: the stats' `curve` (tokens, agreement).
    """
    from trainers.builds.learning_curve import probe_steps

    steps, lr, warmup, min_lr_ratio = sched.steps, sched.lr, sched.warmup, sched.min_lr_ratio
    grad_clip, progress, desc, probe = sched.grad_clip, sched.progress, sched.desc, sched.probe
    t_head = teacher_head[vocab_ids].detach().to(compute_dtype())  # [n, H]
    opt = make_optimizer(student, lr, weight_decay=0.0)
    losses, tokens, curve, probing = [], 0, [], 0.0
    marks = probe_steps(steps) if probe is not None else set()
    student.train()
    t0 = time.perf_counter()
    bar = progress_bar(steps, desc, progress)
    try:
        for step, idx in window_batches(windows.shape[0], batch, steps, seed):
            f = lr_factor(step, steps, warmup, min_lr_ratio)
            for gr in opt.param_groups:
                gr["lr"] = gr["initial_lr"] * f
            with train_autocast():
                h = student.model(input_ids=windows[idx, :-1]).last_hidden_state  # [B, T, H]
                s_logits = F.linear(h, student.lm_head.weight[vocab_ids])  # [B, T, n]
                t_logits = F.linear(states[idx].to(t_head.dtype), t_head)  # [B, T, n]
            losses.append(optimizer_step(student.parameters(), opt, subset_kl(s_logits, t_logits), grad_clip))
            tokens += idx.numel() * (windows.shape[1] - 1)
            bar.set_postfix(kl=f"{losses[-1]:.3f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}", refresh=False)
            bar.update(1)
            if step + 1 in marks:
                tp = time.perf_counter()
                student.eval()
                curve.append({"step": step + 1, "tokens": tokens, "kl": losses[-1], "agreement": probe(student)})
                student.train()
                probing += time.perf_counter() - tp
    finally:
        bar.close()
        student.eval()
    wall = time.perf_counter() - t0 - probing
    tail = losses[-max(1, len(losses) // 10):]
    return {"steps": steps, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / max(wall, 1e-9),
            "first_loss": losses[0], "final_loss": sum(tail) / len(tail),
            "epochs": tokens / max(1, windows.numel() - windows.shape[0]), "curve": curve, "probe_s": probing}
