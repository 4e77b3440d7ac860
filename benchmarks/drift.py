"""Drift benchmark on the real `dvi serve` path: α over code -> sql (or chat) -> code traffic, per drafter kind.

For each drafter kind (`separate`, `eagle`) and arm, a real `dvi serve` process (scheduler, swapper
with its shadow check and rollback, supervisor; `serving.demo.ServerProcess`) gets the same greedy
traffic over loopback HTTP, C clients at a time: held-out code prompts (`/v1/completions`, token
ids), then held-out requests of the drift domain (`/v1/chat/completions`; `--drift sql`, the default:
`dvi.data.sql_instructions`, SQLite queries, a domain the build never trained on; `--drift chat`:
`dvi.data.chat_instructions`, 30% of the build's text), then other held-out code prompts. α per request is read from each response's `dvi` block.

* ``online``: the server's supervised trainer trains the drafter from the feedback log under a
  machine-independent budget: at most one step per `trainer.feedback_tokens_per_step` feedback
  tokens (enforced by the trainer, reported in its status: steps, feedback tokens read); idle
  replay fills the budget, never more. Between phases the client waits until the trainer has read
  every record and the swapper has decided on LATEST, so phase boundaries do not depend on the
  machine's speed. Afterwards the throughput probe: the same code prompts in ABBA blocks with the
  trainer paused / running (`/admin/trainer/pause`, `/admin/trainer/resume`).
* ``frozen``: `serve.trainer=off`; the bootstrap drafter serves all three phases.
* ``ceiling``: the bootstrap drafter distilled offline on the drift domain's *training* text (the target's
  greedy replies to its training-split requests, `trainers.pretrained_build.greedy_replies`) for 5x the
  online arm's trained tokens up to the end of its drift phase (`trainers.subset_distill` for
  separate, `trainers.eagle_build.distill_eagle` for eagle), then *served* by `dvi serve` (trainer
  off) on the same drift requests.

Goals per kind (issue 25 §1): the ceiling's drift α at least 0.08 above the frozen arm's (something to
recover); the online arm's rolling α closes 70% of that gap within 20,000 feedback tokens of the new
domain (the tokens it needed are reported, with trainer steps and seconds); online code α on return
within 0.02 of before the switch; the frozen arm's drift α does not rise (second half minus first <=
0.02: no gain from prompt choice); tokens/s with the trainer running >= 0.9x paused. Every arm's greedy
text must be identical (lossless). `--rescore JSON` recomputes the goals of a saved run.

    python benchmarks/drift.py --preset smollm2 [--kinds separate,eagle] [--json bench_results/drift.json]

Writes JSON (settings, per-request rows of every arm, swap events, trainer status, `goals`) and a
PNG beside it, prints a table ending with the goals, exits 0 whether or not they are met.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import secrets
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import built_pair, clean_json, goal, goal_line
from dvi.decode.results import acceptance_rate
from dvi.rundir import RunDir

PHASES = ("code", "drift", "code_return")
DRIFTS = ("sql", "chat")  # sql: never in the build's text; chat: 30% of it
KINDS = ("separate", "eagle")


# -- traffic ----------------------------------------------------------------------------------------
def traffic(tok: Any, args: argparse.Namespace) -> dict[str, list]:
    """Per phase: code prompts (token ids) or the drift domain's chat messages (rendered <= --drift-prompt-tokens)."""
    from dvi.data import chat_instructions, prompt_stream, render_chat, sql_instructions

    def code(seed: int) -> list[list[int]]:
        s = prompt_stream("code", tok, split="heldout", prompt_tokens=(32, 96), seed=seed)
        return list(itertools.islice(s, args.code_requests))

    source = sql_instructions if args.drift == "sql" else chat_instructions
    chats = (m for m in source("heldout", seed=args.seed) if len(render_chat(tok, m)) <= args.drift_prompt_tokens)
    return {"code": code(args.seed), "drift": list(itertools.islice(chats, args.drift_requests)),
            "code_return": code(args.seed + 1), "probe": code(args.seed + 2)[: args.probe_prompts]}


async def _send(client: Any, item: list, max_tokens: int, drift: str) -> dict:
    chat = isinstance(item[0], dict)
    body = {"messages" if chat else "prompt": item, "max_tokens": max_tokens, "temperature": 0.0,
            "metadata": {"domain": drift if chat else "code"}}
    r = await client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
    b = r.json()
    c = b["choices"][0]
    text = c["message"]["content"] if chat else c["text"]
    return {**{k: b["dvi"][k] for k in ("drafted", "accepted", "steps", "drafter_version")},
            "tokens": b["usage"]["completion_tokens"], "text": text}


def run_requests(url: str, items: list, args: argparse.Namespace, on_done: Any = None,
                 first: int = 0) -> tuple[list[dict], float]:
    """Every item once (numbered from `first`), `args.concurrency` in flight; rows in completion order, wall time."""
    import httpx

    async def go() -> list[dict]:
        rows: list[dict] = []
        queue = iter(enumerate(items, first))
        async with httpx.AsyncClient(base_url=url, timeout=900) as client:
            async def worker() -> None:
                for i, item in queue:
                    row = {"prompt": i, **await _send(client, item, args.max_tokens, args.drift), "t": time.time()}
                    rows.append({**row, **(on_done() if on_done else {})})
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return rows

    t0 = time.perf_counter()
    rows = asyncio.run(go())
    return rows, time.perf_counter() - t0


# -- the server --------------------------------------------------------------------------------------
def pair_overrides(pair_dir: Path, preset: str, kind: str, drafter: Path | None) -> list[str]:
    """Explicit paths (so `dvi serve` never bootstraps), the preset's served dtype and draft vocabulary."""
    from dvi.drafters.vocab import draft_vocab_path
    from dvi.models.embedded import EmbeddedPaths
    from dvi.models.loading import preset_draft_vocab, saved_kind, serving_dtype

    p = EmbeddedPaths.at(pair_dir)
    if drafter is None:
        drafter = p.drafter if kind == "separate" else (p.eagle if saved_kind(p.eagle) == kind else None)
    n = preset_draft_vocab(preset)
    out = [f"models.preset={preset}", f"models.target={p.target}", f"models.tokenizer={p.tokenizer}",
           f"models.drafter_kind={kind}", f"models.dtype={serving_dtype(preset, 'auto', 'cpu')}", "models.device=cpu"]
    out += [f"models.drafter={drafter}"] if drafter is not None else []
    out += [f"models.draft_vocab_size={n}"] if n is not None else []
    if kind != "separate" and draft_vocab_path(p.drafter).is_file():  # the pair's one draft vocabulary
        out += [f"models.draft_vocab={p.drafter}"]
    return out


class Server:
    """`dvi serve` with the benchmark's config (written owner-only: it holds the admin token)."""

    def __init__(self, args: argparse.Namespace, run_dir: Path, overrides: list[str]) -> None:
        import yaml

        from dvi.config import dump_config, load_config
        from dvi.fsutil import PRIVATE, atomic_write_text

        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir, self.token = run_dir, secrets.token_hex(16)
        cfg = load_config(args.config, [
            f"run_dir={run_dir}", f"feedback.dir={run_dir / 'feedback'}", f"registry.dir={run_dir / 'registry'}",
            "feedback.shard_records=8", "feedback.flush_seconds=1", "serve.registry_poll_seconds=1",
            f"serve.max_batch_size={args.concurrency}", "wandb.mode=disabled",
            f"trainer.feedback_tokens_per_step={args.feedback_tokens_per_step}", *overrides, *args.overrides])
        self.cfg = cfg
        data = dump_config(cfg)
        data["serve"]["admin_token"] = self.token
        self.config_path = run_dir / "serve_config.yaml"
        atomic_write_text(self.config_path, yaml.safe_dump(data, sort_keys=False), mode=PRIVATE)

    def __enter__(self) -> Server:
        from serving.demo import ServerProcess

        self.proc = ServerProcess(["--config", str(self.config_path)], self.run_dir / "server.log", cwd=ROOT)
        self.proc.__enter__()
        self.url = self.proc.url
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.__exit__(*exc)

    def admin(self, method: str, path: str) -> dict:
        import httpx

        r = httpx.request(method, self.url + path, headers={"Authorization": f"Bearer {self.token}"}, timeout=60)
        r.raise_for_status()
        return r.json()

    def trainer(self) -> dict:
        return RunDir(self.run_dir).read_trainer_status()

    def snapshot(self) -> dict:
        st = self.trainer()
        return {"trainer_step": st.get("dvi_trainer_step"), "feedback_tokens": st.get("feedback_tokens"),
                "records_read": st.get("records_read"), "tokens_trained": st.get("tokens_trained"),
                "train_seconds": st.get("train_seconds")}

    def wait_trainer(self, states: tuple[str, ...], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (st := self.trainer()).get("state") in states and st.get("heartbeat", 0) > time.time() - 5:
                return st
            time.sleep(0.25)
        raise TimeoutError(f"trainer not {states} after {timeout}s; see {self.run_dir}/trainer.log")

    def settle(self, timeout: float) -> float:
        """Wait until every record is written and read by the trainer, its steps have stopped (budget spent or
        nothing to replay), and the swapper has decided on LATEST (promoted, refused or rolled back); returns
        the seconds waited. This makes α a function of the budget, not of how fast this machine trains."""
        t0, last = time.monotonic(), None
        while time.monotonic() - t0 < timeout:
            h, st = self.admin("GET", "/health"), self.trainer()
            sw, fb = h["drafter"] or {}, h["feedback"]
            # decided, or waiting on traffic that only the next wave brings (a rollback watch counts served
            # records): waiting for it here would only burn the timeout
            decided = (sw.get("latest") in (None, sw.get("live_version")) or str(sw.get("latest")) in sw.get("refused", {})
                       or sw.get("watch") is not None)
            read = fb["pending"] == 0 and (st.get("records_read") or 0) >= fb["records_written"]
            now = (st.get("records_read"), st.get("dvi_trainer_step"))
            if read and st.get("state") == "idle" and decided and now == last:
                break
            last = now
            time.sleep(1.0)
        return time.monotonic() - t0


def run_arm(name: str, args: argparse.Namespace, work: Path, overrides: list[str], phases: dict[str, list],
            probe: list | None = None) -> dict:
    """Serve `phases` in order on a fresh server; the online arm settles between phases and ends with the probe."""
    online = name == "online"
    with Server(args, work / name, [f"serve.trainer={'supervised' if online else 'off'}", *overrides]) as srv:
        out: dict[str, Any] = {"rows": [], "phases": {}, "settle_s": {}}
        if online:
            out["trainer_start"] = srv.wait_trainer(("idle", "running"), 600)
        for phase, items in phases.items():
            rows, wall, step = [], 0.0, args.wave if online else len(items)
            for i in range(0, len(items), step):  # online: waves, each followed by the trainer's budget
                r, w = run_requests(srv.url, items[i: i + step], args, srv.snapshot if online else None, first=i)
                rows, wall = rows + r, wall + w
                if online:
                    out["settle_s"][f"{phase}@{i}"] = srv.settle(args.settle_s)
            out["rows"] += [{**r, "phase": phase} for r in rows]
            out["phases"][phase] = {"wall_s": wall, "end": srv.snapshot()}
            print(f"  {name}: {phase} α {alpha(rows):.3f} ({len(rows)} requests, {wall:.0f}s serving)", flush=True)
        if probe is not None:
            out["probe"] = throughput_probe(srv, probe, args)
        out["status"] = srv.admin("GET", "/admin/status")
        out["trainer_final"] = srv.trainer()
    return out


def throughput_probe(srv: Server, prompts: list, args: argparse.Namespace) -> dict:
    """Paused / running blocks of the same prompts in ABBA order; ratio = median over adjacent pairs."""
    blocks = []
    for p in range(args.probe_pairs):
        for mode in (("paused", "running") if p % 2 == 0 else ("running", "paused")):
            srv.admin("POST", "/admin/trainer/pause" if mode == "paused" else "/admin/trainer/resume")
            srv.wait_trainer(("paused",) if mode == "paused" else ("idle", "running"), 120)
            s0, c0 = srv.snapshot(), srv.admin("GET", "/health")["drafter"]["counts"]
            rows, wall = run_requests(srv.url, prompts, args)
            s1, c1 = srv.snapshot(), srv.admin("GET", "/health")["drafter"]["counts"]
            toks = sum(r.get("tokens", 0) for r in rows)
            blocks.append({"mode": mode, "tokens": toks, "seconds": wall, "tokens_per_s": toks / wall,
                           "alpha": alpha(rows), "trainer_steps": (s1["trainer_step"] or 0) - (s0["trainer_step"] or 0),
                           "swap_decisions": sum(c1.values()) - sum(c0.values())})
    srv.admin("POST", "/admin/trainer/resume")
    ratios = []
    for a, b in zip(blocks[::2], blocks[1::2], strict=True):
        run, paused = (a, b) if a["mode"] == "running" else (b, a)
        ratios.append(run["tokens_per_s"] / paused["tokens_per_s"])

    def tps(mode: str) -> float:
        xs = [b for b in blocks if b["mode"] == mode]
        return sum(x["tokens"] for x in xs) / sum(x["seconds"] for x in xs)

    return {"blocks": blocks, "pair_ratios": ratios, "ratio": statistics.median(ratios),
            "tokens_per_s_paused": tps("paused"), "tokens_per_s_running": tps("running")}


# -- the ceiling ---------------------------------------------------------------------------------------
def drift_training_set(pair_dir: Path, args: argparse.Namespace) -> dict:
    """The target's greedy replies to training-split requests of the drift domain, cut into windows, with its
    states."""
    import torch

    from dvi.data import chat_prompt_stream, sql_prompt_stream
    from dvi.models.embedded import EmbeddedPaths
    from dvi.models.loading import load_causal_lm, load_tokenizer
    from trainers.offline import pack_docs
    from trainers.pretrained_build import greedy_replies
    from trainers.subset_distill import teacher_states

    p = EmbeddedPaths.at(pair_dir)
    t0 = time.perf_counter()
    target = load_causal_lm(p.target, "cpu", "bfloat16")
    tok = load_tokenizer(p.tokenizer)
    stream_of = sql_prompt_stream if args.drift == "sql" else chat_prompt_stream
    prompts = list(itertools.islice(stream_of(tok, "train", seed=args.seed, max_tokens=args.drift_prompt_tokens),
                                    args.ceiling_prompts))
    chats = greedy_replies(target, tok, prompts, args.ceiling_reply_tokens)
    stream = pack_docs(chats, None, None)
    t = args.ceiling_seq_len
    n = stream.numel() // (t + 1)
    windows = stream[: n * (t + 1)].view(n, t + 1)
    states = teacher_states(target, windows)
    del target
    return {"windows": windows, "states": states, "conversations": len(chats), "tokens": int(stream.numel()),
            "label_s": time.perf_counter() - t0, "dtype": str(torch.bfloat16)}


def build_ceiling(kind: str, pair_dir: Path, data: dict, tokens: int, out: Path, args: argparse.Namespace) -> dict:
    """The bootstrap drafter of `kind` distilled on the drift domain's windows for >= `tokens` token-passes; saved to `out`."""
    import torch

    from dvi.drafters.vocab import draft_vocab_path, load_draft_vocab
    from dvi.models.embedded import EmbeddedPaths, get_preset
    from dvi.models.loading import load_causal_lm, saved_kind

    p = EmbeddedPaths.at(pair_dir)
    w, s = data["windows"], data["states"]
    steps = max(1, math.ceil(tokens / (args.ceiling_batch * (w.shape[1] - 1))))
    src = p.drafter if kind == "separate" else p.eagle
    train_vocab = getattr(get_preset(args.preset), "train_vocab", None)
    target = load_causal_lm(p.target, "cpu", "float32")
    for prm in target.parameters():
        prm.requires_grad_(False)
    ids = load_draft_vocab(p.drafter, train_vocab, int(target.config.vocab_size))
    ids = torch.arange(int(target.config.vocab_size)) if ids is None else ids
    from trainers.offline import TrainSchedule

    sched = TrainSchedule(steps=steps, lr=args.ceiling_lr, warmup=5, progress=False, desc=f"ceiling[{kind}]")
    kw = {"batch": args.ceiling_batch, "seed": args.seed}
    if kind == "separate":
        from trainers.subset_distill import distill_subset

        student = load_causal_lm(src, "cpu", "float32")
        stats = distill_subset(student, target.lm_head.weight, w, s, ids, sched, **kw)
        student.to(torch.bfloat16).save_pretrained(out)
    else:
        from dvi.drafters.eagle import EagleDrafter
        from trainers.eagle_build import EagleData, distill_eagle

        d = EagleDrafter.load(target, src) if saved_kind(src) == "eagle" else EagleDrafter(target)
        stats = distill_eagle(d, EagleData(w, s), ids, sched, **kw)
        d.save(out)
    if draft_vocab_path(p.drafter).is_file():
        shutil.copyfile(draft_vocab_path(p.drafter), draft_vocab_path(out))
    return {**stats, "online_tokens_x5": tokens, "from": str(src)}


# -- figures -------------------------------------------------------------------------------------------
def alpha(rows: list[dict]) -> float:
    """Pooled α of response rows; NaN (not dvi.decode.results' None) where nothing was drafted, because the
    figures do arithmetic on it and plot NaN as a gap (`clean_json` writes it as null)."""
    a = acceptance_rate(sum(r.get("accepted", 0) for r in rows), sum(r.get("drafted", 0) for r in rows))
    return float("nan") if a is None else a


def rolling(rows: list[dict], w: int) -> list[float]:
    return [alpha(rows[max(0, i + 1 - w): i + 1]) for i in range(len(rows))]


def phase_rows(arm: dict, phase: str) -> list[dict]:
    return [r for r in arm["rows"] if r["phase"] == phase]


def text_mismatches(arms: dict[str, dict]) -> int:
    """Requests whose greedy text differs from the frozen arm's for the same prompt. Not a goal: bf16 CPU serving
    is not batch-invariant (the same server and drafter give different greedy text at another concurrency)."""
    ref = {(r["phase"], r["prompt"]): r.get("text") for r in arms["frozen"]["rows"]}
    return sum(ref.get((r["phase"], r["prompt"])) != r.get("text") for a in ("online", "ceiling") for r in arms[a]["rows"])


def budget_to_reach(chat: list[dict], level: float, w: int, start: dict) -> dict:
    """Feedback tokens / trainer steps / seconds into the drift phase when the rolling α first reaches `level`."""
    roll = rolling(chat, w)
    hit = next((j for j, a in enumerate(roll) if j + 1 >= w and a >= level), None)
    end = chat[-1] if hit is None else chat[hit]

    def delta(key: str) -> float | None:
        a, b = end.get(key), start.get(key)
        return None if a is None or b is None else a - b

    return {"reached": hit is not None, "at_request": None if hit is None else hit + 1, "level": level,
            "feedback_tokens": delta("feedback_tokens"), "trainer_steps": delta("trainer_step"),
            "tokens_trained": delta("tokens_trained"), "train_seconds": delta("train_seconds"),
            "seconds": end["t"] - chat[0]["t"]}


GAP_MIN = 0.08          # issue 25: the frozen drafter is at least this far below the ceiling on the new domain
CLOSE_SHARE = 0.7       # ... and the online arm closes this share of that gap
CLOSE_TOKENS = 20_000   # ... within this many feedback tokens of the new domain


def kind_goals(kind: str, arms: dict[str, dict], w: int) -> tuple[dict, list[dict]]:
    """Issue 25 §1's goals from the three arms' per-request rows (same drift prompts in every arm)."""
    on, fr = arms["online"], arms["frozen"]
    ceiling = alpha(arms["ceiling"]["rows"])
    chat_on, chat_fr = phase_rows(on, "drift"), phase_rows(fr, "drift")
    frozen = alpha(chat_fr)
    start = on["phases"]["code"]["end"]
    level = frozen + CLOSE_SHARE * (ceiling - frozen)
    b = budget_to_reach(chat_on, level, w, start)
    chat_end = on["phases"]["drift"]["end"]
    spent = {k: (chat_end.get(k) or 0) - (start.get(k) or 0) for k in ("feedback_tokens", "trainer_step",
                                                                       "tokens_trained", "train_seconds")}
    code_pre, code_ret = alpha(phase_rows(on, "code")), alpha(phase_rows(on, "code_return"))
    half = len(chat_fr) // 2
    frozen_drift_gain = alpha(chat_fr[half:]) - alpha(chat_fr[:half])
    closed = (alpha(chat_on[-w:]) - frozen) / (ceiling - frozen) if ceiling > frozen else float("nan")
    probe = on["probe"]
    summary = {"ceiling_alpha": ceiling, "frozen_drift_alpha": frozen, "gap": ceiling - frozen,
               "online_drift_last_window": alpha(chat_on[-w:]), "frozen_drift_last_window": alpha(chat_fr[-w:]),
               "gap_closed_last_window": closed, "frozen_drift_second_minus_first_half": frozen_drift_gain,
               "code_pre": code_pre, "code_return": code_ret,
               "frozen_code_return_minus_pre": alpha(phase_rows(fr, "code_return")) - alpha(phase_rows(fr, "code")),
               "budget_to_close": b, "drift_phase_budget": spent,
               "throughput_ratio": probe["ratio"], "greedy_text_mismatches": text_mismatches(arms)}
    reach = (f"reached at request {b['at_request']} after {b['feedback_tokens']} feedback tokens, {b['trainer_steps']} "
             f"steps" if b["reached"] else f"not reached in {spent['feedback_tokens']} feedback tokens")
    goals = [
        goal(f"{kind}: ceiling α - frozen α on the new domain (something to recover)", ceiling - frozen, GAP_MIN),
        goal(f"{kind}: feedback tokens until the online arm (rolling {w}) closed {CLOSE_SHARE:.0%} of that gap, "
             f"α {level:.3f}; {reach}", b["feedback_tokens"] if b["reached"] else None, CLOSE_TOKENS,
             higher_is_better=False),
        goal(f"{kind}: online code α on return minus before the switch (frozen arm's shift: "
             f"{summary['frozen_code_return_minus_pre']:+.3f}, other prompts)", code_ret - code_pre, -0.02),
        goal(f"{kind}: frozen α on the new domain, second half minus first (no gain from prompt choice)",
             frozen_drift_gain, 0.02, higher_is_better=False),
        goal(f"{kind}: tokens/s trainer running / paused (median of {len(probe['pair_ratios'])} ABBA pairs)",
             probe["ratio"], 0.9),
    ]
    return summary, goals


def plot(path: Path, results: dict[str, dict], w: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(12, 4.5 * len(results)), squeeze=False)
    for ax, (kind, res) in zip(axes[:, 0], results.items(), strict=True):
        arms = res["arms"]
        n_code = len(phase_rows(arms["frozen"], "code"))
        top = 0.0
        for name, color in (("online", "tab:green"), ("frozen", "tab:gray"), ("ceiling", "tab:purple")):
            rows = arms[name]["rows"]
            x0 = n_code if name == "ceiling" else 0
            ys = [a for p in PHASES for a in rolling(phase_rows(arms[name], p), w)]  # windows restart per phase
            top = max([top, *(y for y in ys if not math.isnan(y))])
            ax.plot(range(x0 + 1, x0 + len(rows) + 1), ys, color=color, label=f"{name} (rolling {w}, per phase)")
        ends = list(itertools.accumulate(len(phase_rows(arms["frozen"], p)) for p in PHASES))
        for x in ends[:-1]:
            ax.axvline(x + 0.5, color="k", ls=":", lw=1)
        for x, p in zip([0, *ends[:-1]], PHASES, strict=True):
            ax.text(x + 1, 0.02, p, fontsize=9)
        ax2 = ax.twinx()
        on = arms["online"]["rows"]
        ax2.step(range(1, len(on) + 1), [r.get("drafter_version", 0) for r in on], color="tab:orange", where="post",
                 alpha=0.6, label="online drafter version")
        ax2.set_ylabel("drafter version")
        ax.set(ylim=(0, min(1.0, 1.25 * top) or 1.0), xlabel="request (completion order)", ylabel="α", title=kind)
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="upper right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: dict[str, dict], goals: list[dict]) -> str:
    lines = [f"{'kind':<9} {'arm':<8} " + " ".join(f"{p:>12}" for p in PHASES), "-" * 70]
    for kind, res in results.items():
        for arm in ("online", "frozen", "ceiling"):
            a = res["arms"][arm]
            cells = [phase_rows(a, p) for p in PHASES]
            lines.append(f"{kind:<9} {arm:<8} " + " ".join(f"{alpha(c):>12.3f}" if c else f"{'-':>12}" for c in cells))
    lines.append("\ngoals:")
    for g in goals:
        v = "nan" if g["value"] is None else f"{g['value']:.3f}"
        lines.append(f"  [{'met' if g['met'] else 'MISSED'}] {g['name']}: {v} "
                     f"({'>=' if g['higher_is_better'] else '<='} {g['target']})")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=("tiny", "smollm2"), default="smollm2")
    ap.add_argument("--pair-dir", type=Path, default=None, help="a built pair (default: the preset's cache dir)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "drift.yaml"))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--code-requests", type=int, default=12, help="per code phase")
    ap.add_argument("--drift", choices=DRIFTS, default="sql", help="the domain traffic drifts to")
    ap.add_argument("--drift-requests", type=int, default=72)
    ap.add_argument("--drift-prompt-tokens", type=int, default=320)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--feedback-tokens-per-step", type=int, default=64, help="the online trainer's budget")
    ap.add_argument("--window", type=int, default=12, help="requests in the rolling α window")
    ap.add_argument("--wave", type=int, default=8, help="online arm: requests between waits for the trainer")
    ap.add_argument("--settle-s", type=float, default=180.0, help="max wait for the trainer after a wave")
    ap.add_argument("--probe-prompts", type=int, default=8)
    ap.add_argument("--probe-pairs", type=int, default=2)
    ap.add_argument("--ceiling-prompts", type=int, default=96, help="training-split drift requests whose replies the ceiling distils on")
    ap.add_argument("--ceiling-reply-tokens", type=int, default=128)
    ap.add_argument("--ceiling-seq-len", type=int, default=128)
    ap.add_argument("--ceiling-batch", type=int, default=8)
    ap.add_argument("--ceiling-lr", type=float, default=5e-4)
    ap.add_argument("--ceiling-multiple", type=float, default=5.0, help="x the online arm's trained tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=Path("bench_results/drift.json"))
    ap.add_argument("--rescore", type=Path, default=None, help="recompute the goals of this saved run and exit")
    ap.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides for every server")
    return ap.parse_args(argv)


def save_partial(args: argparse.Namespace, kind: str, arms: dict) -> None:
    """The arms finished so far, beside the final JSON (an hour-long run that dies late keeps them)."""
    path = args.json.with_suffix(f".{kind}.partial.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean_json({"kind": kind, "arms": arms}), default=str))


def run_kind(kind: str, pair_dir: Path, args: argparse.Namespace, items: dict[str, list], work: Path,
             chat_set: dict) -> dict:
    base = pair_overrides(pair_dir, args.preset, kind, None)
    phases = {p: items[p] for p in PHASES}
    t0 = time.perf_counter()
    arms = {"online": run_arm("online", args, work, base, phases, probe=items["probe"])}
    save_partial(args, kind, arms)
    arms["frozen"] = run_arm("frozen", args, work, base, phases)
    save_partial(args, kind, arms)
    if "windows" not in chat_set:
        chat_set.update(drift_training_set(pair_dir, args))
    chat_end = arms["online"]["phases"]["drift"]["end"]
    tokens = int(args.ceiling_multiple * (chat_end.get("tokens_trained") or 0))
    ceiling_dir = work / "ceiling_drafter"
    tc = time.perf_counter()
    stats = build_ceiling(kind, pair_dir, chat_set, tokens, ceiling_dir, args)
    stats["build_s"] = time.perf_counter() - tc
    print(f"  ceiling: {stats['tokens']} token-passes ({stats['steps']} steps, {stats['build_s']:.0f}s), "
          f"loss {stats['first_loss']:.3f} -> {stats['final_loss']:.3f}", flush=True)
    arms["ceiling"] = run_arm("ceiling", args, work, pair_overrides(pair_dir, args.preset, kind, ceiling_dir),
                              {"drift": items["drift"]})
    arms["ceiling"]["training"] = stats
    summary, goals = kind_goals(kind, arms, args.window)
    return {"arms": arms, "summary": summary, "goals": goals, "wall_s": time.perf_counter() - t0}


def rescore(path: Path, w: int) -> int:
    """Recompute a saved run's goals (after a change of the goals, or of the window) and print them."""
    out = json.loads(path.read_text())
    out["goals"] = []
    for kind, res in out["kinds"].items():
        res["summary"], res["goals"] = kind_goals(kind, res["arms"], w)
        out["goals"] += res["goals"]
    path.write_text(json.dumps(clean_json(out), indent=1, default=str))
    for g in out["goals"]:
        print(goal_line(g))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rescore is not None:
        return rescore(args.rescore, args.window)
    pair_dir, tok = built_pair(args.preset, args.pair_dir)
    items = traffic(tok, args)
    work = args.json.parent / "drift_work"
    shutil.rmtree(work, ignore_errors=True)
    results, goals, chat_set = {}, [], {}
    t0 = time.perf_counter()
    for kind in [k for k in args.kinds.split(",") if k]:
        print(f"[{kind}] online, frozen, ceiling ...", flush=True)
        results[kind] = run_kind(kind, pair_dir, args, items, work / kind, chat_set)
        goals += results[kind]["goals"]
    png = args.json.with_suffix(".png")
    plot(png, results, args.window, f"dvi drift ({args.preset}): code -> {args.drift} -> code over `dvi serve`, greedy, "
         f"{args.concurrency} clients, budget 1 step / {args.feedback_tokens_per_step} feedback tokens")
    out = {"benchmark": "drift", "settings": {**vars(args), "pair_dir": str(pair_dir),
                                              "drift_training": {k: v for k, v in chat_set.items()
                                                                if k not in ("windows", "states")}},
           "kinds": results, "goals": goals, "wall_s": time.perf_counter() - t0, "png": str(png)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(clean_json(out), indent=1, default=str))
    print(table(results, goals))
    for kind, res in results.items():
        s = res["summary"]
        print(f"{kind}: ceiling α {s['ceiling_alpha']:.3f}; drift budget {s['drift_phase_budget']}; throughput "
              f"{s['throughput_ratio']:.3f}x; greedy text differs from the frozen arm's in {s['greedy_text_mismatches']} "
              f"requests (bf16 batch numerics, see text_mismatches)")
    print(f"wrote {args.json} and {png} ({out['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
