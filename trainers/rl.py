"""A small, self-contained GRPO loop on the real target, for demos and benchmarks.

Each step samples `n` completions at temperature 1 (with EOS, so rows finish at different lengths) for
each of `prompts_per_step` prompts of a task (`trainers.rl_tasks`: by default seeded arithmetic word
problems with a verifiable reward) with dvi's speculative `RolloutEngine` (or the same engine without a
drafter: the plain-sampling arm), takes one GRPO step on a LoRA policy (peft) and pushes the LoRA-merged
weights into the rollout engine with `update_target_weights`, so the next batch samples the new policy.

The target drifts away from what the drafter was distilled on, so a frozen drafter's α lags, while the
online arm trains the drafter between RL steps on the feedback of the current policy (target version on
every record; older versions down-weighted by `trainers.online.OnlineTrainer`, exactly as the trainer
process does). Speculation pays only where the batch has drained to a few long rows: with `adaptive`,
the engine picks K per step from calibrated costs per batch-size bucket, so full batches decode plainly
and the tail speculates; `StepLog.speculated_tokens` counts the tokens generated with K > 0.

Run one arm: ``python -m trainers.rl --arm online --steps 20`` (smollm2); all three side by side:
``benchmarks/rl.py``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from dvi.decode.results import DraftCounts, fmt_rate, pooled_rates
from dvi.rollout import Rollout, RolloutStats
from trainers.grpo import (
    completion_logprobs,
    group_advantages,
    logprob_gap,
    lora_policy,
    policy_gradient_loss,
)
from trainers.rl_tasks import TASKS, Problem, score, task_prompts

ARMS = ("plain", "frozen", "online", "suffix", "hybrid", "history")
"""How rollouts are made: no drafter, the built drafter frozen or trained online, the suffix index alone
(over this run's own rollouts), hybrid (suffix index, else the frozen drafter), or history (the suffix index
with the GRPO group's live siblings in it and its drafts priced per row: `dvi.rollout_history`)."""

if TYPE_CHECKING:
    from trainers.online.trainer import OnlineTrainer

# ---------------------------------------------------------------------------------------------
# the loop


def epochs(items: Iterator, size: int, seed: int) -> Iterator:
    """The first `size` of `items`, then the same ones epoch after epoch, each epoch in a new seeded order."""
    pool = list(itertools.islice(items, size))
    if len(pool) < size:
        raise ValueError(f"dataset_size {size}: the task has only {len(pool)} problems")
    rng = random.Random(seed)
    while True:
        order = pool[:]
        rng.shuffle(order)
        yield from order


@dataclass
class RLConfig:
    """Settings of one RL run (one arm of the benchmark)."""

    # plain | frozen | online | suffix (suffix index over this run's rollouts, no drafter) | hybrid (suffix, else
    # the frozen drafter) | history (suffix index + live siblings, drafts priced per row: `dvi.rollout_history`);
    # the suffix arms' index decays outputs of older policy versions (`dvi.drafters.suffix_proposer`)
    arm: str = "online"
    preset: str = "smollm2"
    pair_dir: str | None = None  # built pair dir (defaults to the preset's cache dir)
    steps: int = 20
    prompts_per_step: int = 3
    # a finite dataset, as RL runs iterate epochs over their prompts: the task's first `dataset_size` problems,
    # in a new seeded order every epoch (a prompt's rollouts of an earlier epoch are then SPEC-RL's drafts for
    # the `history` arm); 0: a fresh problem every time
    dataset_size: int = 0
    n: int = 4  # samples per prompt (GRPO group size)
    max_new_tokens: int = 64
    prompt_tokens: tuple[int, int] = (16, 48)  # code tasks only
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    reward: str = "arith"  # the task: arith | upper | ast | short_lines (trainers.rl_tasks)
    lr: float = 2e-3  # LoRA: moves the policy measurably within ~15 steps of 12-16 rows
    grad_clip: float = 1.0
    lora_rank: int = 16  # the policy's LoRA (peft)
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    # LoRA on the top N decoder layers only (0: all): the backward pass stops at the lowest adapted
    # layer, so a GRPO step on CPU costs about half of an all-layer adapter's.
    lora_top_layers: int = 10
    dtype: str = "auto"  # target, policy and served drafter: the preset's serving dtype (bf16 for smollm2)
    num_draft_tokens: int = 3  # fixed K, or the controller's default K when adaptive
    max_draft_tokens: int = 4
    adaptive: bool = True  # K per step from calibrated costs: plain at full batch, speculation in the tail
    # the drafter's next candidates per depth beside its chain, as many as pay (0: chains; None: 3 with adaptive K)
    tree_width: int | None = None
    # online drafter training (arm == "online"): trainers.online.OnlineTrainer, in process
    drafter_mode: str = "lora"  # lora | full (trainer.mode)
    drafter_lr: float = 3e-3
    drafter_batch_size: int = 8
    drafter_replay_steps: int = 2  # extra replay-only trainer steps per RL step on the newest records
    drafter_reward_ramp_start: int = 20  # trainer steps of pure KL before the accept/reject reward ramps in
    feedback_top_k: int = 32
    seed: int = 0
    sample_seed: int | None = None  # the rollouts' draws (None: `seed`); the same prompts under other draws
    threads: int | None = 1
    kl_every: int = 5
    feedback_dir: str | None = None

    def __post_init__(self) -> None:
        if self.arm not in ARMS:
            raise ValueError(f"arm must be one of {', '.join(ARMS)}, got {self.arm!r}")
        if self.drafter_mode not in ("lora", "full"):
            raise ValueError(f"drafter_mode must be 'lora' or 'full', got {self.drafter_mode!r}")
        if self.reward not in TASKS:
            raise ValueError(f"reward must be one of {list(TASKS)}, got {self.reward!r}")
        for name in ("steps", "prompts_per_step", "n", "max_new_tokens", "lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dataset_size and self.dataset_size < self.prompts_per_step:
            raise ValueError(f"dataset_size must be 0 (fresh problems) or >= prompts_per_step "
                             f"({self.prompts_per_step}), got {self.dataset_size}")
        self.prompt_tokens = tuple(self.prompt_tokens)  # type: ignore[assignment]
        self.lora_targets = tuple(self.lora_targets)


class Rolled(NamedTuple):
    """One step's rollouts, as `RLRun.roll` made them, waiting for `RLRun.learn`."""
    rolls: list[Rollout]
    stats: RolloutStats
    rewards: torch.Tensor


@dataclass(kw_only=True)
class StepLog(DraftCounts):
    """What one RL step measured: the rollouts' `DraftCounts` summed over the batch (α and mean accepted
    length are its properties: None when nothing was drafted, `dvi.decode.results`), plus the step's times."""

    step: int
    reward: float
    rollout_s: float
    tokens: int
    update_s: float
    sync_s: float
    drafter_s: float
    target_version: int
    drafter_version: int
    speculated_tokens: int = 0  # tokens emitted by engine steps with K > 0
    kl_to_init: float = float("nan")
    logprob_gap: float = float("nan")  # mean |policy - rollout| log-prob of the sampled tokens
    loss: float = float("nan")
    drafter_loss: float = float("nan")


def _json_float(x: float) -> float | None:
    return None if (isinstance(x, float) and (math.isnan(x) or math.isinf(x))) else x


class RLRun:
    """One arm of the RL benchmark: rollouts -> reward -> GRPO step on the LoRA policy -> weight push.

    The rollout engine's target and the trainable policy are separate modules (as in any RL system
    where the generator and the learner differ), so the weight push is real. The `frozen` and
    `online` arms share everything except that the online arm trains the drafter on each batch's
    feedback records between RL steps and hot-swaps it into the engine.
    """

    def __init__(self, cfg: RLConfig, log: Callable[[str], None] | None = print) -> None:
        from dvi.models.embedded import embedded_dir
        from dvi.models.loading import serving_dtype

        self.cfg = cfg
        self.log = log or (lambda _m: None)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.root = Path(cfg.pair_dir) if cfg.pair_dir else embedded_dir(cfg.preset)
        self.dtype = serving_dtype(cfg.preset, cfg.dtype, "cpu")
        self._load_pair()
        self.policy = lora_policy(self.root / "target", self.dtype, cfg.lora_rank, cfg.lora_targets,
                                  cfg.lora_top_layers)
        self.opt = torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad], lr=cfg.lr,
                                     betas=(0.9, 0.99), weight_decay=0.0)
        self._build_engine()
        self._prompts = task_prompts(cfg.reward, self.tokenizer, cfg.seed, cfg.prompt_tokens)
        if cfg.dataset_size:
            self._prompts = epochs(self._prompts, cfg.dataset_size, cfg.seed)
        self.drafter_trainer = None
        self._scratch: Any = None
        if cfg.arm == "online":
            self.drafter_trainer = self._online_trainer()
        self.logs: list[StepLog] = []

    def _load_pair(self) -> None:
        """Tokenizer, target and (dvi arms) drafter with the preset's draft vocabulary, in the serving dtype."""
        from dvi.models.loading import load_pair, preset_draft_vocab

        drafter_dir = self.root / "drafter" if self.cfg.arm not in ("plain", "suffix", "history") else None
        pair = load_pair(self.root / "target", drafter_dir, self.root / "tokenizer", device="cpu",
                         dtype=self.dtype, draft_vocab_size=preset_draft_vocab(self.cfg.preset))
        self.tokenizer, self.drafter = pair.tokenizer, pair.drafter
        self.target = pair.target
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_id = self.tokenizer.eos_token_id

    def _build_engine(self) -> None:
        """The speculative engine (no drafter in the plain arm), its costs calibrated up front."""
        from dvi.drafters.factory import make_proposer
        from dvi.engine.speculative import SpeculativeEngine
        from dvi.rollout import RolloutEngine, rollout_options

        cfg = self.cfg
        vocab = int(self.target.get_output_embeddings().weight.shape[0])
        name = {"plain": "none", "frozen": "separate", "online": "separate"}.get(cfg.arm, cfg.arm)
        if cfg.arm == "history":
            from dvi.rollout_history import history_proposer

            proposer = history_proposer(vocab, "cpu")
        else:
            proposer = make_proposer(name, self.drafter, vocab, "cpu")  # frozen / online: the drafter as is
        self.engine = SpeculativeEngine(
            self.target, proposer, num_draft_tokens=cfg.num_draft_tokens, adaptive=cfg.adaptive,
            max_draft_tokens=max(cfg.max_draft_tokens, cfg.num_draft_tokens),
            feedback_top_k=cfg.feedback_top_k if cfg.arm == "online" else 0,
            options=rollout_options(self.target, cfg.adaptive, cfg.tree_width),  # as RolloutEngine.speculative
        )
        self.calibrate_s = 0.0
        if cfg.adaptive and self.engine.proposer.name != "none":
            # One-off cost per bucket, the same whatever the weights: measured here, outside the rollouts.
            t0 = time.perf_counter()
            batch, buckets = cfg.prompts_per_step * cfg.n, [1]
            while buckets[-1] < batch:
                buckets.append(buckets[-1] * 2)
            # five repetitions a width (the engine's lazy default is three): the costs price every step of the run,
            # and on a CPU shared with other work a few more samples keep one stall from turning speculation on
            self.engine.calibrate(buckets, reps=5)
            self.calibrate_s = time.perf_counter() - t0
        self.writer = None
        if cfg.feedback_dir:
            from dvi.feedback import FeedbackWriter

            self.writer = FeedbackWriter(cfg.feedback_dir, shard_records=10**9, flush_seconds=1e9)
        self.rollouts = RolloutEngine(self.engine, feedback_writer=self.writer, domain="rl",
                                      stop_token_ids=[self.eos_id] if self.eos_id is not None else None)

    def _online_trainer(self) -> OnlineTrainer:
        """`trainers.online.OnlineTrainer` over a float32 copy of the drafter (same draft vocabulary): the
        online loss, replay, stale-version down-weighting, exactly as the trainer process runs them, minus
        the shard round trip. The engine serves a plain copy with the adapter merged in, as a server does
        on swap: an unmerged LoRA forward costs several extra small matmuls per layer."""
        import tempfile

        from dvi.config import DviConfig
        from dvi.drafters.vocab import apply_draft_vocab, find_subset_head
        from dvi.models.loading import load_causal_lm
        from trainers.online.trainer import OnlineTrainer

        cfg = self.cfg
        drafter = load_causal_lm(self.root / "drafter", device="cpu", dtype="float32")
        head = find_subset_head(self.drafter)
        if head is not None:
            apply_draft_vocab(drafter, head.token_ids.cpu())
        self._scratch = tempfile.TemporaryDirectory(prefix="dvi-rl-")
        dcfg = DviConfig.model_validate({
            "run_dir": self._scratch.name, "seed": cfg.seed, "models": {"device": "cpu", "dtype": "float32"},
            "trainer": {
                "mode": cfg.drafter_mode, "learning_rate": cfg.drafter_lr, "batch_size": cfg.drafter_batch_size,
                "heldout_fraction": 0.0, "reward_ramp_start": cfg.drafter_reward_ramp_start,
                "num_threads": cfg.threads or 1, "seed": cfg.seed,
            },
        })
        return OnlineTrainer(dcfg, drafter, run_dir=self._scratch.name, pad_id=self.pad_id)

    # -- one step, phase by phase ------------------------------------------------------------------
    def _rollouts(self, i: int) -> tuple[list[Problem], list[Rollout]]:
        """This step's prompts and `n` rollouts of each (seeded by run seed and step)."""
        cfg = self.cfg
        batch = [next(self._prompts) for _ in range(cfg.prompts_per_step)]
        rolls = self.rollouts.generate_rollouts(
            [ids for ids, _ in batch], n=cfg.n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            top_p=cfg.top_p, top_k=cfg.top_k, seed=(cfg.seed if cfg.sample_seed is None else cfg.sample_seed) * 100_003 + i,
        )
        return [batch[r.prompt_index][1] for r in rolls], rolls

    def _rewards(self, problems: list[Problem], rolls: list[Rollout]) -> torch.Tensor:
        texts = [self.tokenizer.decode(r.completion_ids, skip_special_tokens=True) for r in rolls]
        return torch.tensor([score(self.cfg.reward, p, t) for p, t in zip(problems, texts, strict=True)])

    def _update_policy(self, i: int, rolls: list[Rollout], rewards: torch.Tensor) -> dict[str, float]:
        """One GRPO step (on-policy, group-normalised advantages); loss, seconds, KL to init, log-prob gap."""
        cfg = self.cfg
        p_ids, c_ids = [r.prompt_ids for r in rolls], [r.completion_ids for r in rolls]
        t0 = time.perf_counter()
        logps, mask = completion_logprobs(self.policy, p_ids, c_ids, cfg.temperature, self.pad_id)
        loss = policy_gradient_loss(logps, mask, group_advantages(rewards, cfg.n))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_([p for p in self.policy.parameters() if p.requires_grad], cfg.grad_clip)
        self.opt.step()
        out = {"loss": float(loss.detach()), "update_s": time.perf_counter() - t0,
               "logprob_gap": logprob_gap(logps, mask, rolls), "kl": float("nan")}
        if cfg.kl_every and (i % cfg.kl_every == 0 or i == cfg.steps - 1):
            out["kl"] = self._kl_to_init(p_ids, c_ids, logps, mask)
        return out

    def _kl_to_init(self, prompts: list[list[int]], completions: list[list[int]], logps: torch.Tensor,
                    mask: torch.Tensor) -> float:
        """KL(policy || initial target) per token on the sampled tokens: how far the target moved.

        The k3 estimator E[r - 1 - log r], r = p_init / p_policy: unbiased and never negative. The
        initial target is the policy with its adapter switched off (no third model in memory).
        """
        with torch.no_grad(), self.policy.disable_adapter():
            ref_logps, _ = completion_logprobs(self.policy, prompts, completions, self.cfg.temperature, self.pad_id)
        m = mask.float()
        log_r = (ref_logps - logps.detach()) * m
        k3 = (torch.exp(log_r) - 1.0 - log_r) * m
        return float(k3.sum() / m.sum().clamp_min(1.0))

    def _push_policy(self, i: int, policy: torch.nn.Module | None = None) -> float:
        """The LoRA-merged weights of `policy` (default: this run's) into the engine's target as version i + 1;
        seconds taken."""
        from dvi.rollout import policy_state_dict

        t0 = time.perf_counter()
        self.rollouts.update_target_weights(policy_state_dict(policy or self.policy, adapted_only=True),
                                            version=i + 1)
        return time.perf_counter() - t0

    def _train_drafter(self, i: int) -> tuple[float, float]:
        """Online arm: train on this batch's records (+ replay), swap the merged drafter in; (seconds, loss)."""
        if self.drafter_trainer is None:
            return 0.0, float("nan")
        from dvi.rollout import policy_state_dict

        cfg = self.cfg
        t0 = time.perf_counter()
        out = self.drafter_trainer.train_on_records(self.rollouts.last_records())
        if cfg.drafter_replay_steps:
            out = self.drafter_trainer.train_on_replay(cfg.drafter_replay_steps)
        adapted = cfg.drafter_mode == "lora"
        self.drafter.load_state_dict(policy_state_dict(self.drafter_trainer.model, adapted_only=adapted),
                                     strict=not adapted)
        # The version bump makes the engine rebuild its drafter cache and tags the next records.
        self.rollouts.set_drafter(self.drafter, self.rollouts.drafter_version + 1)
        # The trainer-process protocol: whoever updates the target announces its version, so records
        # of older policies are down-weighted from now on.
        self.drafter_trainer.rundir.write_target_version(i + 1)
        return time.perf_counter() - t0, out.loss

    def step(self, i: int, leader: RLRun | None = None) -> StepLog:
        """Rollouts -> rewards -> GRPO step -> weight push -> (online) drafter step; one StepLog."""
        return self.learn(i, self.roll(i), leader)

    def roll(self, i: int) -> Rolled:
        """Step i's rollouts and their rewards: the timed half of a step, which lockstep callers order apart from
        the other half (`benchmarks/rl.py` rotates the arms so none always rolls out right after a backward pass)."""
        problems, rolls = self._rollouts(i)
        stats = self.rollouts.last_stats
        assert stats is not None
        return Rolled(rolls, stats, self._rewards(problems, rolls))

    def learn(self, i: int, rolled: Rolled, leader: RLRun | None = None) -> StepLog:
        """The GRPO step on `rolled`, the weight push and the drafter step; one StepLog.

        With `leader` (a run that has taken its own step i already) this run learns nothing itself: it pushes the
        leader's updated policy instead, so both sample the same policy on the same prompts every step and differ
        only in how rollouts are made (the speed comparison without trajectories that drift apart by chance)."""
        rolls, stats, rewards = rolled
        if leader is None:
            upd = self._update_policy(i, rolls, rewards)
        else:
            upd = {"update_s": 0.0, "kl": float("nan"), "logprob_gap": float("nan"), "loss": float("nan")}
        sync_s = self._push_policy(i, None if leader is None else leader.policy)
        drafter_s, drafter_loss = self._train_drafter(i)
        if self.writer is not None:
            self.writer.flush()
        rec = StepLog(
            **{f.name: getattr(stats, f.name) for f in fields(DraftCounts)},
            step=i, reward=float(rewards.mean()), rollout_s=stats.seconds, tokens=stats.num_tokens,
            update_s=upd["update_s"], sync_s=sync_s, drafter_s=drafter_s, target_version=stats.target_version,
            drafter_version=stats.drafter_version, speculated_tokens=stats.num_speculated_tokens, kl_to_init=upd["kl"], logprob_gap=upd["logprob_gap"],
            loss=upd["loss"], drafter_loss=drafter_loss,
        )
        self.logs.append(rec)
        self.log(
            f"[{self.cfg.arm}] step {i:3d} reward {rec.reward:.3f} alpha {fmt_rate(rec.alpha)} "
            f"spec {rec.speculated_tokens / max(rec.tokens, 1):.2f} rollout {rec.rollout_s:.2f}s "
            f"({rec.tokens / max(rec.rollout_s, 1e-9):.0f} tok/s) update {rec.update_s:.2f}s "
            f"drafter {drafter_s:.2f}s kl {rec.kl_to_init:.4f}"
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

    def summary(self, alpha_from: int = 10) -> dict[str, Any]:
        """Per-arm totals the benchmark compares; α is token-weighted (accepted / drafted)."""
        logs = self.logs
        late = [r for r in logs if r.step >= alpha_from] or logs
        tokens = sum(r.tokens for r in logs)
        return {
            "arm": self.cfg.arm,
            "seed": self.cfg.seed,
            "steps": len(logs),
            "calibrate_s": self.calibrate_s,
            "rollout_s_total": sum(r.rollout_s for r in logs),
            "update_s_total": sum(r.update_s for r in logs),
            "sync_s_total": sum(r.sync_s for r in logs),
            "drafter_s_total": sum(r.drafter_s for r in logs),
            "tokens_total": tokens,
            "speculated_share": sum(r.speculated_tokens for r in logs) / tokens if tokens else None,
            "alpha_mean": _alpha_of(logs),
            "alpha_from_step": alpha_from,
            "alpha_late": _alpha_of(late),
            "alpha_first5": _alpha_of(logs[:5]),
            "reward_first5": sum(r.reward for r in logs[:5]) / max(1, len(logs[:5])),
            "reward_last5": sum(r.reward for r in logs[-5:]) / max(1, len(logs[-5:])),
        }


def _alpha_of(rs: Sequence[StepLog]) -> float | None:
    return pooled_rates(rs)[0]


def logs_to_jsonable(logs: Sequence[StepLog]) -> list[dict]:
    out = []
    for r in logs:
        d = {**asdict(r), "alpha": r.alpha, "mean_accepted_length": r.mean_accepted_length}
        out.append({k: (_json_float(v) if isinstance(v, float) else v) for k, v in d.items()})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m trainers.rl --arm online --steps 20`: one arm on the real pair, per-step log lines."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arm", default="online", choices=list(ARMS))
    ap.add_argument("--preset", default="smollm2")
    ap.add_argument("--pair-dir", default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reward", default="arith", choices=list(TASKS))
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
