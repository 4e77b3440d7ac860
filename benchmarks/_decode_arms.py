"""The arms `benchmarks/decode.py` measures and the figures it computes from their runs.

Arms: HF `generate` (plain, assisted, prompt lookup; `hf_generate`), HF with a static cache + torch.compile in its
own process (`hf_compiled`), and dvi's engine through the step API (`dvi_run`) with the drafters of every kind
(`build_drafters`; `suffix` / `hybrid` through `model_free_drafter`). Prompts: `prompt_source`. Figures:
`merge_runs` (pooled counts), `same_text` (lossless check), `predicted` (the speedup α, K and the measured costs
allow).
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch

from dvi.decode.k_choice import expected_tokens
from dvi.decode.kv import left_pad
from dvi.decode.results import acceptance_rate, mean_accepted_length
from dvi.decode.step_costs import batch_bucket
from dvi.engine.speculative import Request, SamplingParams, SpeculativeEngine

ROOT = Path(__file__).resolve().parent.parent


def _hf_config(model, temperature: float, n: int):
    gc = copy.deepcopy(model.generation_config)
    gc.max_new_tokens = gc.min_new_tokens = n
    gc.eos_token_id = None
    gc.pad_token_id = 0 if gc.pad_token_id is None else gc.pad_token_id
    gc.do_sample = temperature > 0
    gc.temperature = temperature if temperature > 0 else None
    gc.top_k = 0 if temperature > 0 else None
    gc.top_p = None
    return gc


@torch.inference_mode()
def hf_generate(target, batches, n, temperature, assistant=None, seed=0, lookup: int = 0) -> tuple[float, int, list]:
    """Seconds, tokens and the generated ids per row for HF generate over `batches` (left-padded); `assistant`:
    assisted generation, `lookup` > 0: prompt-lookup decoding with that many candidate tokens (both batch 1
    only in HF)."""
    gc = _hf_config(target, temperature, n)
    if lookup:
        gc.prompt_lookup_num_tokens = lookup
    total_t, total_tok, texts = 0.0, 0, []
    for bi, batch in enumerate(batches):
        ids, valid = left_pad(batch, target.device)
        m = ids.shape[1]
        kw = dict(generation_config=gc, attention_mask=valid.long())
        if assistant is not None:
            kw["assistant_model"] = assistant
        torch.manual_seed(seed + bi)
        t0 = time.perf_counter()
        out = target.generate(ids, **kw)
        _sync(out.device)
        total_t += time.perf_counter() - t0
        total_tok += int((out.shape[1] - m) * len(batch))
        texts += out[:, m:].tolist()
    return total_t, total_tok, texts


def hf_compiled(args, batches, warmup, n: int) -> tuple[float, int, list] | None:
    """HF generate with a static cache + torch.compile over `batches` (greedy), in its own process bounded by
    --hf-compile-timeout (compilation included): (seconds, tokens, texts), None if it did not finish."""
    import subprocess

    job = dict(preset=args.preset, root=args.root, device=args.device, dtype=args.dtype, threads=args.threads,
               batches=batches, warmup=warmup, max_new_tokens=n)
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hf_compiled.py")], input=json.dumps(job),
                              capture_output=True, text=True, timeout=args.hf_compile_timeout)
    except subprocess.TimeoutExpired:
        print(f"  HF static cache + torch.compile: not done within {args.hf_compile_timeout:.0f} s", flush=True)
        return None
    if proc.returncode != 0:
        print(f"  HF static cache + torch.compile failed: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  HF static cache + torch.compile: compiled in {r['compile_s']:.0f} s", flush=True)
    return r["seconds"], r["tokens"], r["texts"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dvi_run(engine: SpeculativeEngine, batches, n, temperature, seed=0) -> dict:
    """Run batches through the step API; record per-step K and accepted counts for the predicted speedup."""
    total_t, tokens, drafted, accepted, steps = 0.0, 0, 0, 0, 0
    ks: list[tuple[int, int]] = []  # (batch size, K) per step
    acc_n = tried_n = 0  # per-position (iid) acceptance: accepted / (accepted + first rejections)
    texts: dict[str, list[int]] = {}  # request id -> generated ids
    acc_pos = [0] * engine.k_cap
    dr_pos = [0] * engine.k_cap
    for bi, batch in enumerate(batches):
        for i, p in enumerate(batch):
            sp = SamplingParams(max_new_tokens=n, temperature=temperature, seed=seed + 1000 * bi + i)
            engine.add_request(Request(f"b{bi}-{i}", p, sp))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            b = engine.num_active()
            outs = engine.step()
            k = engine.last_k
            ks.append((b, k))
            for o in outs:
                if k and not o.finished:
                    m = len(o.new_token_ids) - 1
                    acc_n += m
                    tried_n += m + (1 if m < k else 0)
                if o.finished and o.result is not None:
                    r = o.result
                    texts[o.request_id] = list(r.token_ids)
                    tokens += len(r.token_ids)
                    drafted += r.num_drafted
                    accepted += r.num_accepted
                    steps += r.num_steps
                    for j in range(len(acc_pos)):
                        acc_pos[j] += r.accepted_per_position[j]
                        dr_pos[j] += r.drafted_per_position[j]
        total_t += time.perf_counter() - t0
    return dict(
        seconds=total_t,
        tokens=tokens,
        tokens_per_s=tokens / total_t if total_t else 0.0,
        num_drafted=drafted, num_accepted=accepted, num_steps=steps, acc_n=acc_n, tried_n=tried_n,
        accepted_per_position=acc_pos, drafted_per_position=dr_pos,
        alpha=acceptance_rate(accepted, drafted),
        alpha_per_position=acceptance_rate(acc_n, tried_n),
        mean_accepted_length=mean_accepted_length(accepted, steps),
        per_position_acceptance=[acceptance_rate(a, d) for a, d in zip(acc_pos, dr_pos, strict=True)],
        k_per_step=ks,
        texts=[texts[k] for k in sorted(texts)],
    )


def serve_history(plain: SpeculativeEngine, caches: list, stream, count: int, n: int) -> None:
    """Serve `count` prompts of `stream` greedily (speculation off: the same text any kind would emit) and add
    each output, behind its prompt's tail, to every suffix cache, as `SuffixProposer.close_row` does."""
    from dvi.drafters.suffix_proposer import finished_entry

    for i in range(count):
        prompt = next(stream)
        entry = finished_entry(prompt, dvi_run(plain, [[prompt]], n, 0.0)["texts"][0])
        for cache in caches:
            cache.add_finished(f"history-{i}", entry)


def same_text(a: list[list[int]], b: list[list[int]]) -> float | None:
    """Share of rows whose generated ids are identical in two runs over the same prompts (None: no rows)."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a) if a else None


def merge_runs(runs: list[dict]) -> dict:
    """Aggregate several dvi_run results: counts are summed, then the rates computed once (pooled)."""
    if len(runs) == 1:
        return runs[0]
    sec = sum(r["seconds"] for r in runs)
    tok = sum(r["tokens"] for r in runs)
    n = {key: sum(r[key] for r in runs) for key in ("num_drafted", "num_accepted", "num_steps", "acc_n", "tried_n")}
    acc_pos, dr_pos = ([sum(col) for col in zip(*(r[key] for r in runs), strict=True)]
                       for key in ("accepted_per_position", "drafted_per_position"))
    return dict(
        seconds=sec,
        tokens=tok,
        tokens_per_s=tok / sec if sec else 0.0,
        **n,
        alpha=acceptance_rate(n["num_accepted"], n["num_drafted"]),
        alpha_per_position=acceptance_rate(n["acc_n"], n["tried_n"]),
        mean_accepted_length=mean_accepted_length(n["num_accepted"], n["num_steps"]),
        accepted_per_position=acc_pos, drafted_per_position=dr_pos,
        per_position_acceptance=[acceptance_rate(a, d) for a, d in zip(acc_pos, dr_pos, strict=True)],
        texts=[t for r in runs for t in r["texts"]],
        k_per_step=[x for r in runs for x in r["k_per_step"]],
    )


def predicted(engine: SpeculativeEngine, run: dict) -> dict:
    """Speedup over plain decoding that alpha, the K used and the measured (calibrated) costs allow:
    sum of E[tokens/step] over the run's steps / sum of (K*c_draft + c_verify(K)), relative to c_verify(0)."""
    c = engine.controller.costs
    alpha = run["alpha_per_position"] or 0.0  # i.i.d. per-position acceptance; None only if K was 0 throughout
    tok = tim = base = 0.0
    for b, k in run["k_per_step"]:
        bb = batch_bucket(b)
        c_plain = c.verify_cost(bb, 0)
        if c_plain is None:
            continue
        tok += b * expected_tokens(alpha, k)
        tim += (k * (c.draft_cost(bb) or 0.0) if k else 0.0) + c.verify_cost(bb, k)
        base += c_plain  # a plain step of b rows emits b tokens
    plain_rate = sum(b for b, _ in run["k_per_step"]) / base if base else 0.0
    rate = tok / tim if tim else 0.0
    ks = [k for _, k in run["k_per_step"]]
    return dict(
        predicted_speedup=rate / plain_rate if plain_rate else None,
        mean_k=sum(ks) / max(1, len(ks)),
        calibrated_c_draft_ms={b: v * 1e3 for b, v in c.draft.items()},
        calibrated_c_verify_ms={b: {k: v * 1e3 for k, v in d.items()} for b, d in c.verify.items()},
        online_c_draft_ms={b: v * 1e3 for b, v in engine.costs.draft.items()},
        online_c_verify_ms={b: {k: v * 1e3 for k, v in d.items()} for b, d in engine.costs.verify.items()},
    )


def prompt_source(domain: str, tok, seed: int):
    """Held-out prompts of a domain as token ids: raw code/prose cuts, or chat instructions rendered with
    the tokenizer's chat template."""
    from dvi import data

    if domain == "chat":
        return data.chat_prompt_stream(tok, "heldout", seed=seed, max_tokens=320)
    if domain == "agentic":
        return data.agentic_prompt_stream(tok, "heldout", seed=seed, max_tokens=448)
    return data.prompt_stream(domain, tok, split="heldout", prompt_tokens=(48, 96), seed=seed)


def build_drafters(pair, kinds: list[str], args, caches: list | None = None) -> dict:
    """name -> engine drafter for every kind measured: `separate` (the pair's drafter, reduced head as
    stored or `--draft-vocab`), `eagle` (the head `dvi bootstrap` built, same draft vocabulary),
    `early_exit` (the target's first layers + exit head, same draft vocabulary), `suffix` / `hybrid` (their
    suffix caches are appended to `caches`)."""
    from dvi.drafters.eagle import EagleDrafter
    from dvi.drafters.learned import EarlyExitDrafter, SeparateDrafter
    from dvi.drafters.vocab import find_subset_head
    from dvi.models.embedded import embedded_paths

    out = {}
    head = find_subset_head(pair.drafter)
    ids = head.token_ids if head is not None else None
    for kind in kinds:
        if kind in MODEL_FREE:
            learned = build_drafters(pair, [args.hybrid_kind], args)[args.hybrid_kind] if kind == "hybrid" else None
            out[kind] = model_free_drafter(kind, pair.target, learned, caches if caches is not None else [])
        elif kind == "separate":
            out[kind] = SeparateDrafter(pair.drafter)
        elif kind == "eagle":
            path = embedded_paths(args.preset, args.root).eagle
            if not path.is_dir():
                raise SystemExit(f"no eagle head at {path}: run `dvi bootstrap --preset {args.preset}`")
            out[kind] = EagleDrafter.load(pair.target, path, vocab_ids=ids)
        elif kind == "early_exit":
            out[kind] = EarlyExitDrafter(pair.target, args.early_exit_layers, lora_rank=0, vocab_ids=ids)
        else:
            raise SystemExit(f"unknown drafter kind {kind!r}; expected separate, eagle, early_exit, suffix or hybrid")
    return out


MODEL_FREE = ("suffix", "hybrid")


def _draft_vocab(d) -> int | None:
    """Draft vocabulary size of a drafter or of a hybrid's learned one (None: full, or a suffix drafter)."""
    for obj in (d, getattr(d, "drafter", None)):
        dv = getattr(obj, "draft_vocab", None)
        if dv is not None:
            return int(dv.numel())
    return None


def model_free_drafter(kind: str, target, learned, caches: list):
    """The engine drafter of `suffix` / `hybrid` (issue 26): the one place this benchmark builds them,
    from `dvi.drafters.suffix_proposer` (the engine's proposers) over a fresh `dvi.drafters.suffix.SuffixCache`, which is
    appended to `caches` (the benchmark empties it between settings)."""
    from dvi.drafters.suffix import SuffixCache

    try:
        from dvi.drafters.factory import make_proposer
    except ImportError:
        raise SystemExit(f"drafter kind {kind!r} needs the engine's suffix proposers (dvi.drafters.suffix_proposer)") from None
    cache = SuffixCache()
    caches.append(cache)
    vocab = int(target.get_output_embeddings().weight.shape[0])
    return make_proposer(kind, learned, vocab, next(target.parameters()).device, cache)
