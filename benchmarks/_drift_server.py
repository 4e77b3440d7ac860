"""The drift benchmark's `dvi serve`: the server's overrides for a built pair (`pair_overrides`), the server
process with the benchmark's config and its admin calls (`Server`), and greedy requests over loopback HTTP
(`run_requests`). `benchmarks/soak.py` serves through it too.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time
from pathlib import Path
from typing import Any

from dvi.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent


# -- requests ---------------------------------------------------------------------------------------
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
        from serving.server_process import ServerProcess

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
