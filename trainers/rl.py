"""A small, self-contained RL loop that really moves the target, for demos and benchmarks.

GRPO-style REINFORCE with a group baseline: each step samples `n` completions for each of
`prompts_per_step` code prompts (with dvi's speculative `RolloutEngine`, or the same engine with
speculation off for the plain-sampling arm), scores them with a real reward, takes one policy-
gradient step on a trainable copy of the target, and pushes the new weights into the rollout
engine with `update_target_weights`, so the next batch samples the new policy. That is the
situation dvi is for: the target drifts away from what the drafter was distilled on, so a
frozen drafter's α falls, while the online arm keeps training the drafter on the feedback of
the current policy (target version on every record) and keeps α up. The online arm drives
`trainers.online.OnlineTrainer` in process between RL steps (same loss, replay and stale-version
handling as the trainer process) and serves a merged plain copy of the drafter.

Rewards (`REWARDS`): `upper` (share of upper-case letters in the completion: dense, so the
policy visibly moves within ~40 CPU steps, and far from the code the drafter was distilled on),
`ast` (the prompt plus the completion's complete lines parse with `ast`), `short_lines`.
With the defaults (lr 3e-4, 16 sequences of 32 tokens per step) the `upper` reward climbs from
~0.07 to ~0.3 in 20-40 steps on the `small` target, and the policy's per-token KL to its start
grows steadily: a real, gradual drift, not a collapse in the first update.

Run one arm: ``python -m trainers.rl --arm online --preset tiny --steps 40``; all three side by
side: ``benchmarks/rl.py``.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# ---------------------------------------------------------------------------------------------
# rewards: (prompt_text, completion_text) -> float in [0, 1]


def upper_reward(prompt: str, completion: str) -> float:
    """Share of letters in the completion that are upper case (SHOUTING code)."""
    letters = [c for c in completion if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


def ast_reward(prompt: str, completion: str) -> float:
    """1 if prompt + the completion's complete lines parse as Python, else 0.

    The text may end by opening a block (`if x:`), so a `pass` indented one level under the
    last line is tried too. A completion without one complete non-blank line scores 0.
    """
    body = completion[: completion.rfind("\n") + 1] if "\n" in completion else ""
    if not body.strip():
        return 0.0
    text = prompt + body
    last = next((ln for ln in reversed(text.splitlines()) if ln.strip()), "")
    indent = last[: len(last) - len(last.lstrip())]
    for candidate in (text, f"{text}{indent}    pass\n"):
        try:
            ast.parse(candidate)
            return 1.0
        except (SyntaxError, ValueError):
            continue
    return 0.0


def short_lines_reward(prompt: str, completion: str) -> float:
    """Rewards many line breaks: 1 at one newline per 8 characters or more."""
    return min(1.0, 8.0 * completion.count("\n") / max(1, len(completion)))


REWARDS: dict[str, Callable[[str, str], float]] = {
    "upper": upper_reward,
    "ast": ast_reward,
    "short_lines": short_lines_reward,
}


# ---------------------------------------------------------------------------------------------
# policy-gradient pieces


def group_advantages(rewards: torch.Tensor, n: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean (optionally / group std); groups of `n` rows."""
    if rewards.numel() % n:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of n={n}")
    g = rewards.view(-1, n)
    adv = g - g.mean(dim=1, keepdim=True)
    if scale and n > 1:
        adv = adv / (g.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def _pad_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+completion ids, attention mask, and a mask of completion positions."""
    rows = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    cmask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, rows, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        cmask[i, len(p): len(r)] = True
    return ids.to(device), attn.to(device), cmask.to(device)


def completion_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    temperature: float = 1.0,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``log_softmax(logits / T)`` of each completion token under `model`, one padded batch.

    Returns ``(logps, mask)`` of shape (B, max completion length); gradients flow unless the
    caller disables them. Right padding keeps positions 0..L-1 for every real token, so this is
    exactly a plain forward pass over each prompt + completion.
    """
    dev = next(model.parameters()).device
    ids, attn, cmask = _pad_batch(prompts, completions, pad_id, dev)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    tmask = cmask[:, 1:]
    width = max(1, max(len(c) for c in completions))
    out = torch.zeros((len(completions), width), dtype=logp.dtype, device=dev)
    mask = torch.zeros((len(completions), width), dtype=torch.bool, device=dev)
    for i, c in enumerate(completions):
        if len(c):
            out[i, : len(c)] = logp[i][tmask[i]]
            mask[i, : len(c)] = True
    return out, mask


def policy_gradient_loss(logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """On-policy GRPO loss (ratio = 1, so no clipping): -A * log p, averaged over all tokens."""
    m = mask.float()
    return -(advantages[:, None] * logps * m).sum() / m.sum().clamp_min(1.0)


# ---------------------------------------------------------------------------------------------
# the loop


@dataclass
class RLConfig:
    """Settings of one RL run (one arm of the benchmark)."""

    arm: str = "online"  # plain | frozen | online
    preset: str = "tiny"
    pair_dir: str | None = None  # built pair dir (defaults to the preset's cache dir)
    steps: int = 40
    prompts_per_step: int = 4
    n: int = 4  # samples per prompt (GRPO group size)
    max_new_tokens: int = 32
    prompt_tokens: tuple[int, int] = (16, 48)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    reward: str = "upper"
    lr: float = 3e-4
    grad_clip: float = 1.0
    num_draft_tokens: int = 2  # best fixed K for the small pair on CPU at T=1 (K=4 verifies cost more than α repays)
    adaptive: bool = False
    # online drafter training (arm == "online"): trainers.online.OnlineTrainer, in process
    drafter_mode: str = "lora"  # lora | full (trainer.mode)
    drafter_lr: float = 3e-3
    drafter_batch_size: int = 8
    drafter_replay_steps: int = 2  # extra replay-only trainer steps per RL step on the newest records
    drafter_reward_ramp_start: int = 20  # trainer steps of pure KL before the accept/reject reward ramps in
    feedback_top_k: int = 32
    seed: int = 0
    threads: int | None = 1
    kl_every: int = 5
    feedback_dir: str | None = None

    def __post_init__(self) -> None:
        if self.arm not in ("plain", "frozen", "online"):
            raise ValueError(f"arm must be 'plain', 'frozen' or 'online', got {self.arm!r}")
        if self.drafter_mode not in ("lora", "full"):
            raise ValueError(f"drafter_mode must be 'lora' or 'full', got {self.drafter_mode!r}")
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {sorted(REWARDS)}, got {self.reward!r}")
        for name in ("steps", "prompts_per_step", "n", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.prompt_tokens = tuple(self.prompt_tokens)  # type: ignore[assignment]


@dataclass
class StepLog:
    """What one RL step measured."""

    step: int
    reward: float
    alpha: float
    mean_accepted_length: float
    rollout_s: float
    tokens: int
    update_s: float
    sync_s: float
    drafter_s: float
    target_version: int
    drafter_version: int
    num_drafted: int = 0
    num_accepted: int = 0
    num_steps: int = 0  # engine steps summed over sequences (tokens/step = 1 + accepted / num_steps)
    kl_to_init: float = float("nan")
    loss: float = float("nan")
    drafter_loss: float = float("nan")


def _json_float(x: float) -> float | None:
    return None if (isinstance(x, float) and (math.isnan(x) or math.isinf(x))) else x


class RLRun:
    """One arm of the RL benchmark: rollouts -> reward -> policy-gradient step -> weight push.

    The rollout engine's target and the trainable policy are separate copies (as in any RL
    system where the generator and the learner differ), so the weight push is real. The
    `frozen` and `online` arms share everything except that the online arm trains the drafter
    on each batch's feedback records between RL steps and hot-swaps it into the engine.
    """

    def __init__(self, cfg: RLConfig, log: Callable[[str], None] | None = print) -> None:
        from dvi.data import prompt_stream
        from dvi.embedded import embedded_dir
        from dvi.engine import SpeculativeEngine
        from dvi.models import find_tokenizer_path, load_causal_lm, load_tokenizer
        from dvi.rollout import RolloutEngine

        self.cfg = cfg
        self.log = log or (lambda _m: None)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        root = Path(cfg.pair_dir) if cfg.pair_dir else embedded_dir(cfg.preset)
        self.tokenizer = load_tokenizer(find_tokenizer_path(root / "target"))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_id = self.tokenizer.eos_token_id
        target = load_causal_lm(root / "target", device="cpu", dtype="float32")
        self.policy = load_causal_lm(root / "target", device="cpu", dtype="float32").train()
        self.ref = load_causal_lm(root / "target", device="cpu", dtype="float32") if cfg.kl_every else None
        self.drafter = None
        if cfg.arm != "plain":
            self.drafter = load_causal_lm(root / "drafter", device="cpu", dtype="float32")
        self.engine = SpeculativeEngine(
            target, drafter=self.drafter, num_draft_tokens=cfg.num_draft_tokens, adaptive=cfg.adaptive,
            feedback_top_k=cfg.feedback_top_k if cfg.arm == "online" else 0,
            target_version=0, drafter_version=0,
        )
        self.writer = None
        if cfg.feedback_dir:
            from dvi.feedback import FeedbackWriter

            self.writer = FeedbackWriter(cfg.feedback_dir, shard_records=10**9, flush_seconds=1e9)
        self.rollouts = RolloutEngine(self.engine, feedback_writer=self.writer, domain="rl",
                                      stop_token_ids=[self.eos_id] if self.eos_id is not None else None)
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.reward_fn = REWARDS[cfg.reward]
        self._prompts = prompt_stream("code", self.tokenizer, split="heldout", prompt_tokens=cfg.prompt_tokens,
                                      seed=cfg.seed)
        self.drafter_trainer = None
        self._scratch = None
        if cfg.arm == "online":
            # The trainer trains its own copy (a peft wrapper in LoRA mode); the engine serves a plain
            # model with the adapter merged in, as a server does on swap: an unmerged LoRA forward
            # costs several extra small matmuls per layer, a real share of a tiny drafter's step.
            self.drafter_trainer = self._online_trainer(load_causal_lm(root / "drafter", device="cpu",
                                                                       dtype="float32"))
        self.logs: list[StepLog] = []

    def _online_trainer(self, drafter: torch.nn.Module) -> Any:
        """`trainers.online.OnlineTrainer` over this run's drafter: the online loss, replay, stale-version
        down-weighting, exactly as the trainer process runs them, minus the shard round trip."""
        import tempfile

        from dvi.config import DviConfig
        from trainers.online import OnlineTrainer

        cfg = self.cfg
        self._scratch = tempfile.TemporaryDirectory(prefix="dvi-rl-")
        dcfg = DviConfig.model_validate({
            "run_dir": self._scratch.name,
            "seed": cfg.seed,
            "models": {"device": "cpu", "dtype": "float32"},
            "trainer": {
                "mode": cfg.drafter_mode, "learning_rate": cfg.drafter_lr, "batch_size": cfg.drafter_batch_size,
                "heldout_fraction": 0.0, "reward_ramp_start": cfg.drafter_reward_ramp_start,
                "num_threads": cfg.threads or 1, "seed": cfg.seed,
            },
        })
        return OnlineTrainer(dcfg, drafter, run_dir=self._scratch.name, pad_id=self.pad_id)

    def _kl_to_init(self, prompts: list[list[int]], completions: list[list[int]], logps: torch.Tensor,
                    mask: torch.Tensor) -> float:
        """KL(policy || initial target) per token on the sampled tokens: how far the target moved.

        The k3 estimator E[r - 1 - log r], r = p_init / p_policy: unbiased and never negative.
        """
        assert self.ref is not None
        with torch.no_grad():
            ref_logps, _ = completion_logprobs(self.ref, prompts, completions, self.cfg.temperature, self.pad_id)
        m = mask.float()
        log_r = (ref_logps - logps.detach()) * m
        k3 = (torch.exp(log_r) - 1.0 - log_r) * m
        return float(k3.sum() / m.sum().clamp_min(1.0))

    def step(self, i: int) -> StepLog:
        cfg = self.cfg
        prompts = [next(self._prompts) for _ in range(cfg.prompts_per_step)]
        rolls = self.rollouts.generate_rollouts(
            prompts, n=cfg.n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed * 100_003 + i,
        )
        stats = self.rollouts.last_stats
        assert stats is not None
        p_ids = [r.prompt_ids for r in rolls]
        c_ids = [r.completion_ids for r in rolls]
        rewards = torch.tensor([
            self.reward_fn(self.tokenizer.decode(p), self.tokenizer.decode(c)) for p, c in zip(p_ids, c_ids, strict=True)
        ])
        adv = group_advantages(rewards, cfg.n)

        t0 = time.perf_counter()
        self.policy.train()
        logps, mask = completion_logprobs(self.policy, p_ids, c_ids, cfg.temperature, self.pad_id)
        loss = policy_gradient_loss(logps, mask, adv)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.grad_clip)
        self.opt.step()
        update_s = time.perf_counter() - t0
        kl = float("nan")
        if self.ref is not None and cfg.kl_every and (i % cfg.kl_every == 0 or i == cfg.steps - 1):
            kl = self._kl_to_init(p_ids, c_ids, logps, mask)

        t0 = time.perf_counter()
        from dvi.rollout import policy_state_dict

        self.rollouts.update_target_weights(policy_state_dict(self.policy), version=i + 1)
        sync_s = time.perf_counter() - t0

        drafter_s, drafter_loss = 0.0, float("nan")
        if self.drafter_trainer is not None:
            t0 = time.perf_counter()
            records = self.rollouts.last_records(cfg.temperature)
            out = self.drafter_trainer.train_on_records(records)
            if cfg.drafter_replay_steps:
                out = self.drafter_trainer.train_on_replay(cfg.drafter_replay_steps)
            drafter_loss = float(out.get("loss", float("nan")))
            from dvi.rollout import policy_state_dict

            self.drafter.load_state_dict(policy_state_dict(self.drafter_trainer.model))
            # The version bump makes the engine rebuild its drafter cache and tags the next records.
            self.rollouts.set_drafter(self.drafter, self.rollouts.drafter_version + 1)
            # The trainer-process protocol: whoever updates the target announces its version, so
            # records of older policies are down-weighted from now on.
            from trainers.online import TARGET_VERSION_FILE, write_json_atomic

            write_json_atomic(Path(self.drafter_trainer.run_dir) / TARGET_VERSION_FILE, i + 1)
            drafter_s = time.perf_counter() - t0

        if self.writer is not None:
            self.writer.flush()
        rec = StepLog(
            step=i, reward=float(rewards.mean()), alpha=stats.alpha,
            mean_accepted_length=stats.mean_accepted_length, rollout_s=stats.seconds, tokens=stats.num_tokens,
            update_s=update_s, sync_s=sync_s, drafter_s=drafter_s, target_version=stats.target_version,
            drafter_version=stats.drafter_version, num_drafted=stats.num_drafted,
            num_accepted=stats.num_accepted, num_steps=stats.num_steps, kl_to_init=kl, loss=float(loss.detach()), drafter_loss=drafter_loss,
        )
        self.logs.append(rec)
        self.log(
            f"[{cfg.arm}] step {i:3d} reward {rec.reward:.3f} alpha {rec.alpha:.3f} "
            f"rollout {rec.rollout_s:.2f}s ({rec.tokens / max(rec.rollout_s, 1e-9):.0f} tok/s) "
            f"update {update_s:.2f}s drafter {drafter_s:.2f}s kl {kl:.3f}"
        )
        return rec

    def run(self) -> list[StepLog]:
        for i in range(self.cfg.steps):
            self.step(i)
        self.close()
        return self.logs

    def close(self) -> None:
        """Flush feedback and remove scratch dirs (idempotent)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def summary(self, alpha_from: int = 20) -> dict[str, Any]:
        """Per-arm totals the benchmark compares; α is token-weighted (accepted / drafted)."""
        logs = self.logs
        late = [r for r in logs if r.step >= alpha_from] or logs

        def alpha_of(rs: list[StepLog]) -> float:
            drafted = sum(r.num_drafted for r in rs)
            return sum(r.num_accepted for r in rs) / drafted if drafted else float("nan")

        return {
            "arm": self.cfg.arm,
            "steps": len(logs),
            "rollout_s_total": sum(r.rollout_s for r in logs),
            "update_s_total": sum(r.update_s for r in logs),
            "sync_s_total": sum(r.sync_s for r in logs),
            "drafter_s_total": sum(r.drafter_s for r in logs),
            "tokens_total": sum(r.tokens for r in logs),
            "alpha_mean": alpha_of(logs),
            "alpha_from_step": alpha_from,
            "alpha_late": alpha_of(late),
            "alpha_first5": alpha_of(logs[:5]),
            "reward_first5": sum(r.reward for r in logs[:5]) / max(1, len(logs[:5])),
            "reward_last5": sum(r.reward for r in logs[-5:]) / max(1, len(logs[-5:])),
        }


def logs_to_jsonable(logs: Sequence[StepLog]) -> list[dict]:
    out = []
    for r in logs:
        d = asdict(r)
        out.append({k: (_json_float(v) if isinstance(v, float) else v) for k, v in d.items()})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m trainers.rl --arm online --preset tiny --steps 40`: one arm, per-step log lines."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arm", default="online", choices=["plain", "frozen", "online"])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--pair-dir", default=None)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reward", default="upper", choices=sorted(REWARDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write per-step logs here")
    a = ap.parse_args(argv)
    cfg = RLConfig(arm=a.arm, preset=a.preset, pair_dir=a.pair_dir, steps=a.steps, reward=a.reward,
                   seed=a.seed, threads=a.threads)
    run = RLRun(cfg)
    run.run()
    summary = {k: (_json_float(v) if isinstance(v, float) else v) for k, v in run.summary().items()}
    print(json.dumps(summary, indent=2))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"config": asdict(cfg), "summary": summary,
                                            "steps": logs_to_jsonable(run.logs)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
