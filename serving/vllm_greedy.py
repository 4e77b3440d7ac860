"""The greedy contract behind vLLM (issue 60 §1): how far vLLM's greedy text may stand from the target's own on this
device, measured at start-up, and what judges served text against it.

dvi owns neither vLLM's kernels nor its speculation, so behind vLLM a greedy answer is checked two ways:

- against the target's own argmax: dvi's copy of the served target (the pair loaded in the dtype vLLM serves:
  float32 on a CPU, `serving.loading`), teacher-forced on vLLM's text. vLLM's kernels are not dvi's, so the two
  part where the target's top-2 gap is within their difference: `probe` measures that difference at start-up
  (`deviation`: the largest gap between vLLM's top-k log-prob differences and the reference's logit differences
  over a few greedy answers vLLM speculated, in one batch) and states a `bound` (`BOUND_FACTOR` times it, never below
  the dtype's near-tie, `dvi.decode.sampling.tie_bound`); a token past it is a changed token;
- against vLLM's own text without speculation, which is what lossless means behind an engine dvi does not own:
  `PlainVllm` starts a vLLM without speculation on the same target and replays the prompts (the demo does, for
  every greedy answer).

On a CPU vLLM serves float32 under `serving.vllm_process.FP32_EXACT_ENV` (oneDNN's strict math: no bf16 on AMX),
measured within float32's rounding of the reference (`FP32_DEVIATION` and issue 60's numbers in docs/design.md); a
deviation past `DEGRADED_FACTOR` x that is stated as `degraded` (the kernels or the weights are not float32's).
"""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import torch

from dvi.decode.sampling import tie_bound

from .vllm_process import FP32_EXACT_ENV, PROBE_TOP_K

log = logging.getLogger("dvi.vllm")

PROBE_PROMPTS = (
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "SELECT customer_id, SUM(amount) AS total\nFROM payments\n",
    "The lighthouse keeper climbed the stairs at dusk, as he had every evening for",
    "Explain recursion to a child in three sentences.\n\n",
)
BOUND_FACTOR = 4.0
"""The bound over the measured deviation: a few answers' largest difference is not every answer's."""
FP32_DEVIATION = 2e-4
"""vLLM's float32 CPU kernels against transformers' float32 on the same weights: up to 9.9e-5 over 1024 greedy
positions' top-5 (issue 60, `benchmarks/vllm_greedy.py`); bf16-rounded weights served in float32: 0.10."""
DEGRADED_FACTOR = 10.0


@torch.inference_mode()
def teacher_forced(target: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The target's logits [len(tokens), V] (float32) at each of `tokens`' positions, given the prompt and the
    tokens before it."""
    dev = next(target.parameters()).device
    ids = torch.tensor([list(prompt) + list(tokens)], device=dev)
    return target(ids).logits[0, len(prompt) - 1: len(prompt) + len(tokens) - 1].float().cpu()


def deviation(logits: torch.Tensor, tokens: list[int], tops: list[dict[int, float]]) -> float:
    """The largest |(vLLM's log-prob of t - of its token) - (the reference's logit of t - of that token)| over the
    ids vLLM returned per position: how far vLLM's kernels put the candidates from the reference's."""
    worst = 0.0
    for i, top in enumerate(tops[: len(tokens)]):
        tok = int(tokens[i])
        if tok not in top:
            continue
        for t, lp in top.items():
            worst = max(worst, abs((lp - top[tok]) - float(logits[i, t] - logits[i, tok])))
    return worst


def classify(gap: float, top: float, bound: float, dtype: torch.dtype) -> str:
    """A served token the reference did not rank first, by its gap below the reference's top logit: 'near-tie'
    (the dtype's rounding), 'bound' (within this device's measured bound), else 'changed'."""
    if gap <= tie_bound(top, dtype):
        return "near-tie"
    return "bound" if gap <= bound else "changed"


def complete(url: str, model: str, prompts: list[list[int]], max_tokens: int | list[int], top_k: int = 0,
             concurrency: int = 8) -> list[dict[str, Any]]:
    """Greedy completions of token-id prompts from a vLLM at `url`, `concurrency` in flight, EOS not stopping them:
    per prompt {"tokens": [...], "top": [{id: log-prob}] (top_k > 0)}."""
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)

    def one(args: tuple[list[int], int]) -> dict[str, Any]:
        prompt, n = args
        body = {"model": model, "prompt": list(prompt), "max_tokens": int(n), "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True, "return_tokens_as_token_ids": True, "skip_special_tokens": False}
        if top_k:
            body["logprobs"] = top_k
        r = httpx.post(url + "/v1/completions", json=body, timeout=900.0)
        if r.status_code != 200:
            raise RuntimeError(f"vLLM answered {r.status_code}: {r.text[:300]}")
        c = r.json()["choices"][0]
        tops = [{int(k.rsplit(":", 1)[1]): float(v) for k, v in (e or {}).items()}
                for e in ((c.get("logprobs") or {}).get("top_logprobs") or [])]
        return {"tokens": [int(t) for t in c["token_ids"]], "top": tops}

    with concurrent.futures.ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, zip(prompts, lengths, strict=True)))


def probe(url: str, model: str, target: torch.nn.Module, tokenizer: Any, tokens: int) -> dict[str, Any]:
    """The greedy contract of the vLLM at `url` on this device: `PROBE_PROMPTS` answered greedily in one batch
    (`tokens` each, speculating as it serves), each teacher-forced through `target` (dvi's copy of the served target,
    in vLLM's dtype); the largest deviation, the bound, and what the probe's own tokens were."""
    dtype = next(target.parameters()).dtype
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROBE_PROMPTS]
    answers = complete(url, model, prompts, tokens, top_k=PROBE_TOP_K, concurrency=len(prompts))
    worst, classes = 0.0, {"near-tie": 0, "bound": 0, "changed": 0}
    ref = []
    for p, a in zip(prompts, answers, strict=True):
        logits = teacher_forced(target, p, a["tokens"])
        ref.append(logits)
        worst = max(worst, deviation(logits, a["tokens"], a["top"]))
    floor = tie_bound(1.0, dtype)
    bound = max(BOUND_FACTOR * worst, floor)
    for a, logits in zip(answers, ref, strict=True):
        top = logits.max(-1).values
        gaps = top - logits.gather(-1, torch.tensor(a["tokens"])[:, None])[:, 0]
        for i in (gaps > 0).nonzero().flatten().tolist():
            classes[classify(float(gaps[i]), float(top[i]), bound, dtype)] += 1
    expected = FP32_DEVIATION if dtype == torch.float32 else 8 * tie_bound(20.0, dtype)
    degraded = worst > DEGRADED_FACTOR * expected
    return {"deviation": round(worst, 7), "bound": round(bound, 7), "probe_positions": sum(len(a["tokens"]) for a in answers),
            "probe_off_argmax": sum(classes.values()), "one_request": "degraded" if degraded else "near-tie",
            "batched": "degraded" if degraded else "near-tie"}


def contract(process: Any, target: torch.nn.Module, tokenizer: Any, tokens: int) -> dict[str, Any]:
    """What /health states of greedy behind the vLLM `process` serves: the dtype, the math mode dvi pinned, the
    weights' dtype in dvi (what vLLM was handed), the reference, and the start-up probe's measurement (`tokens` 0:
    none, 'unmeasured')."""
    weights = str(next(target.parameters()).dtype).removeprefix("torch.")
    out: dict[str, Any] = {
        "engine": "vllm", "dtype": process.dtype, "weights": weights,
        "fpmath": ("strict: " + " ".join(f"{k}={v}" for k, v in FP32_EXACT_ENV.items())) if process.dtype == "float32"
        else "vLLM's default",
        "reference": f"the target in {weights}, teacher-forced (transformers)",
        "speculation_off_text": "the demo's check replays greedy answers through vLLM without speculation",
    }
    if weights != process.dtype:
        log.warning("vLLM serves %s but dvi holds the target in %s (models.dtype): the weights vLLM serves are %s-rounded",
                    process.dtype, weights, weights)
    if tokens <= 0:
        return {**out, "one_request": "unmeasured", "batched": "unmeasured"}
    try:
        out.update(probe(process.url, process.served_name, target, tokenizer, tokens))
    except Exception as exc:  # noqa: BLE001 - the server still serves; /health says the contract is unmeasured
        log.exception("the greedy probe of vLLM failed")
        return {**out, "one_request": "unmeasured", "batched": "unmeasured", "probe_error": f"{type(exc).__name__}: {exc}"}
    level = logging.WARNING if out["one_request"] == "degraded" else logging.INFO
    log.log(level, "greedy behind vLLM on this device: %s (vLLM's log-prob gaps within %.2g of the %s reference's over "
            "%d positions; bound %.2g; math %s)", out["one_request"], out["deviation"], weights,
            out["probe_positions"], out["bound"], out["fpmath"])
    return out


class PlainVllm:
    """A vLLM without speculation on `target` (exported to `root`): vLLM's own greedy text, the one a speculating
    vLLM must reproduce. `complete` prompts; `load_target` new weights in place (a checkpoint-format file)."""

    def __init__(self, vcfg: Any, target: torch.nn.Module, tokenizer: Any, root: Path, served_name: str = "dvi"):
        from .vllm_process import VllmProcess, export_target

        self.root = Path(root)
        tdir = export_target(target, tokenizer, self.root / "target")
        self.process = VllmProcess(vcfg.model_copy(update={"port": 0}), tdir, tdir, served_name, 0, 1,
                                   self.root / "vllm-plain.log")

    def __enter__(self) -> PlainVllm:
        self.process.start()
        return self

    def __exit__(self, *exc) -> None:
        self.process.stop()
        shutil.rmtree(self.root / "target", ignore_errors=True)  # a copy of the target's weights; its log stays

    def complete(self, prompts: list[list[int]], lengths: list[int], concurrency: int = 8) -> list[list[int]]:
        return [a["tokens"] for a in complete(self.process.url, self.process.served_name, prompts, lengths,
                                              concurrency=concurrency)]

    def load_target(self, path: Path) -> None:
        url = self.process.url
        r = httpx.post(url + "/collective_rpc", timeout=300.0, json={"method": "dvi_reload_target", "args": [str(path)]})
        if r.status_code != 200:
            raise RuntimeError(f"vLLM could not load {path}: HTTP {r.status_code}: {r.text[:300]}")
        httpx.post(url + "/reset_prefix_cache", timeout=60.0).raise_for_status()


def first_difference(a: Iterable[int], b: Iterable[int]) -> int | None:
    """The first index where two token lists differ over their common length (None: equal there)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
