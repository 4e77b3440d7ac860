"""Build the embedded model pair from the Python standard library (`dvi bootstrap --preset tiny`).

tokenizer (byte-level BPE on code + prose) -> target (Llama, both domains) -> drafter (1-layer
Llama, KL-distilled from the target on code only, so it is a code specialist and prose is the
drift later issues recover from) -> held-out evaluation and latency measurement -> save with
`save_pretrained` into `<dir>/{tokenizer,target,drafter}/` + `manifest.json`, atomically.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dvi import data
from dvi.fsutil import atomic_write_text
from dvi.models.embedded import (
    EmbeddedPaths,
    Preset,
    get_preset,
)
from dvi.models.loading import decode_step_latency, num_params
from trainers.builds.build_common import jsonable, log, timed
from trainers.builds.offline import (
    DISTILL_DEFAULTS,
    PRETRAIN_DEFAULTS,
    TrainSchedule,
    copy_layer,
    distill,
    distinct_token_ratio,
    evaluate_lms,
    pack_docs,
    pretrain_lm,
    token_batches,
)

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


@dataclass
class BuiltPair:
    """An in-memory pair as trained, before (or after) saving."""

    tokenizer: Any
    target: Any
    drafter: Any
    manifest: dict



def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenization, so indentation runs become tokens) with
    bos/eos/pad specials, wrapped as a `PreTrainedTokenizerFast` that prepends BOS like Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=2048, clean_up_tokenization_spaces=False)


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Whole documents to ids without BOS (added when packing), via the fast backend (no length warnings)."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def make_llama(dims, vocab_size: int, max_positions: int, tokenizer, seed: int):
    """A freshly initialised LlamaForCausalLM with the pair's special-token ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **dims.llama_kwargs(),
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def init_drafter_from_target(drafter, target) -> None:
    """Copy the target's embeddings, first decoder layer, final norm and LM head into a drafter of
    the same width: a layer-skip start (the target exiting after its first layer) that already
    speaks the target's token and output space.

    A drafter FFN wider than the target's keeps its extra units' random gate/up weights but starts
    with their down-projection at zero, so it still computes exactly that layer-skip exit and grows
    the extra capacity during distillation (a batch-1 step barely pays for FFN width on CPU).
    """
    d, t = drafter.model, target.model
    with torch.no_grad():
        d.embed_tokens.weight.copy_(t.embed_tokens.weight)
        d.norm.weight.copy_(t.norm.weight)
        drafter.lm_head.weight.copy_(target.lm_head.weight)
    copy_layer(d.layers[0], t.layers[0])


def _latency(target, drafter, steps: int, rounds: int = 3, threads: int = 1) -> dict:
    """Per-token decode cost of each model (batch 1, KV cache), at `threads` torch threads (the
    serving setting; batch-1 steps gain nothing from more, and a busy second core makes two
    threads erratic). Interleaved rounds so machine noise hits both alike; median of medians."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t_ms, d_ms = [], []
        for r in range(rounds):
            t_ms.append(decode_step_latency(target, steps=steps, seed=r) * 1e3)
            d_ms.append(decode_step_latency(drafter, steps=steps, seed=r) * 1e3)
    finally:
        torch.set_num_threads(prev)
    t, d = statistics.median(t_ms), statistics.median(d_ms)
    return {"target_ms": t, "drafter_ms": d, "ratio": t / d, "steps": steps, "rounds": rounds,
            "threads": threads, "target_rounds_ms": t_ms, "drafter_rounds_ms": d_ms}


def _versions() -> dict:
    import tokenizers
    import transformers

    try:
        from importlib.metadata import version

        dvi_v = version("dvi")
    except Exception:  # not installed as a distribution
        dvi_v = "unknown"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__, "dvi": dvi_v}


def build_pair(preset: str | Preset = "tiny", seed: int = 0, progress: bool = True) -> BuiltPair:
    """Train tokenizer, target and drafter in memory and measure them; nothing is written to disk."""
    p = get_preset(preset)
    prev_threads = torch.get_num_threads()
    if p.threads:
        torch.set_num_threads(p.threads)
    try:
        return _build_pair(p, seed, progress)
    finally:
        torch.set_num_threads(prev_threads)


@dataclass
class _Build:
    """What `_build_pair`'s steps produce, in order; `_manifest` reads it all."""

    walls: dict[str, float] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)  # corpus statistics
    tokenizer: Any = None
    bos: int | None = None
    eos: int | None = None
    pad: int | None = None
    code_stream: Any = None  # packed ids, both 1-D tensors
    prose_stream: Any = None
    target: Any = None
    t_stats: dict = field(default_factory=dict)
    drafter: Any = None
    d_stats: dict = field(default_factory=dict)
    heldout: dict = field(default_factory=dict)  # domain -> (docs as ids, characters)
    untrained: dict = field(default_factory=dict)  # the randomly initialised drafter's held-out code loss
    evals: dict = field(default_factory=dict)
    latency: dict = field(default_factory=dict)
    cont: dict = field(default_factory=dict)  # continuation diversity per domain and model


def _build_pair(p: Preset, seed: int, progress: bool) -> BuiltPair:
    """corpus -> tokenizer -> target -> drafter -> evaluation -> manifest (steps below, in this order)."""
    t_start = time.perf_counter()
    b = _Build()
    torch.manual_seed(seed)
    _tokenize(b, p, progress)
    _train_target(b, p, seed, progress)
    _train_drafter(b, p, seed, progress)
    _evaluate(b, p, seed)
    b.walls["total_s"] = time.perf_counter() - t_start
    return BuiltPair(tokenizer=b.tokenizer, target=b.target, drafter=b.drafter, manifest=jsonable(_manifest(b, p, seed)))


def _tokenize(b: _Build, p: Preset, progress: bool) -> None:
    """Sample the training corpus, train the tokenizer on code + prose, pack both domains' ids."""
    with timed(b.walls, "corpus_s"):
        b.stats = data.corpus_stats()
        code_train = data.sample_docs("code", "train", p.train_chars, seed=0)
        prose_train = data.load_texts("prose", "train")
        tok_texts = data.sample_docs("code", "train", max(0, p.tokenizer_chars - sum(map(len, prose_train))), seed=1)
        tok_texts = tok_texts + prose_train
    with timed(b.walls, "tokenizer_s"):
        b.tokenizer = tokenizer = train_tokenizer(tok_texts, p.vocab_size)
        b.bos, b.eos, b.pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
        b.code_stream = pack_docs(_encode(tokenizer, code_train), b.bos, b.eos)
        b.prose_stream = pack_docs(_encode(tokenizer, prose_train), b.bos, b.eos)
    log(f"tokenizer: {len(tokenizer)} tokens; train stream code={b.code_stream.numel():,} "
         f"prose={b.prose_stream.numel():,} tokens ({b.walls['tokenizer_s']:.1f}s)", progress)


def _preset_schedule(p: Preset, who: str, progress: bool) -> TrainSchedule:
    """The preset's training schedule for the `target` or the `drafter`."""
    return TrainSchedule(steps=getattr(p, f"{who}_steps"), lr=getattr(p, f"{who}_lr"),
                         warmup=getattr(p, f"{who}_warmup"), min_lr_ratio=p.min_lr_ratio,
                         weight_decay=(PRETRAIN_DEFAULTS if who == "target" else DISTILL_DEFAULTS)["weight_decay"],
                         max_seconds=getattr(p, f"{who}_max_seconds"), time_schedule=True, progress=progress,
                         desc=f"{who}[{p.name}]", mixed_precision=p.mixed_precision, compile=p.compile,
                         optimizer=p.optimizer, muon_lr=getattr(p, f"{who}_muon_lr"))


def _train_target(b: _Build, p: Preset, seed: int, progress: bool) -> None:
    """The target: next-token training on both domains, mixed at `p.prose_fraction`."""
    with timed(b.walls, "target_s"):
        b.target = make_llama(p.target, len(b.tokenizer), p.max_position_embeddings, b.tokenizer, seed)
        batches = token_batches([b.code_stream, b.prose_stream], p.target_batch, p.seq_len,
                                weights=[1 - p.prose_fraction, p.prose_fraction], seed=seed)
        b.t_stats = pretrain_lm(b.target, batches, schedule=_preset_schedule(p, "target", progress))
    log(f"target: {b.t_stats['tokens']:,} tokens, loss {b.t_stats['final_loss']:.3f}, "
         f"{b.t_stats['tokens_per_s']:.0f} tok/s ({b.walls['target_s']:.0f}s)", progress)


def _train_drafter(b: _Build, p: Preset, seed: int, progress: bool) -> None:
    """The drafter: distilled from the target on code only (its untrained held-out loss first)."""
    with timed(b.walls, "drafter_s"):
        b.drafter = make_llama(p.drafter, len(b.tokenizer), p.max_position_embeddings, b.tokenizer, seed + 1)
        for domain in data.DOMAINS:
            docs = data.sample_docs(domain, "heldout", p.eval_chars, seed=0)
            b.heldout[domain] = (_encode(b.tokenizer, docs), sum(map(len, docs)))
        code_ids, code_chars = b.heldout["code"]
        b.untrained = evaluate_lms({"drafter": b.drafter}, code_ids, code_chars, b.bos, p.seq_len,
                                   pad_id=b.pad, stride=p.eval_stride)["drafter"]  # random init: the baseline
        if p.drafter_init == "target":
            init_drafter_from_target(b.drafter, b.target)
        batches = token_batches([b.code_stream], p.drafter_batch, p.seq_len, seed=seed + 1)
        b.d_stats = distill(b.drafter, b.target, batches, schedule=_preset_schedule(p, "drafter", progress))
    log(f"drafter: {b.d_stats['tokens']:,} tokens, KL {b.d_stats['final_loss']:.3f} ({b.walls['drafter_s']:.0f}s)",
         progress)


def _evaluate(b: _Build, p: Preset, seed: int) -> None:
    """Held-out losses and agreement per domain, decode latency, continuation diversity."""
    with timed(b.walls, "eval_s"):
        for domain, (ids, chars) in b.heldout.items():
            b.evals[domain] = evaluate_lms({"target": b.target, "drafter": b.drafter}, ids, chars, b.bos, p.seq_len,
                                           pad_id=b.pad, agree_with="target", stride=p.eval_stride)
        b.latency = _latency(b.target, b.drafter, p.latency_steps)
        for domain in data.DOMAINS:
            stream = data.prompt_stream(domain, b.tokenizer, "heldout", prompt_tokens=(32, 64), seed=seed)
            prompts = [[b.bos] + next(stream) for _ in range(p.continuation_prompts)]
            b.cont[domain] = {}
            for name, m in (("target", b.target), ("drafter", b.drafter)):
                r = distinct_token_ratio(m, prompts, p.continuation_tokens, pad_id=b.pad)
                b.cont[domain][name] = r["distinct_token_ratio"]
                if name == "target" and r["samples"]:
                    b.cont[domain]["target_sample"] = b.tokenizer.decode(r["samples"][0])


def _per_model(evals: dict, name: str) -> dict:
    out = {}
    for domain in data.DOMAINS:
        e = evals[domain][name]
        out[domain] = {"loss": e["loss"], "bits_per_char": e["bits_per_char"]}
        if "top1_agreement" in e:
            out[domain]["top1_agreement"] = e["top1_agreement"]
    return out


def _manifest(b: _Build, p: Preset, seed: int) -> dict:
    tok, heldout, evals = b.tokenizer, b.heldout, b.evals
    return {
        "preset": p.name,
        "fingerprint": p.fingerprint(),
        "seed": seed,
        "created_at": time.time(),
        "preset_config": asdict(p),
        "corpus": {**b.stats, "split": {"method": "sha256(name) < fraction", "heldout_fraction": data.HELDOUT_FRACTION},
                   "stdlib": str(data.stdlib_dir())},
        "tokenizer": {
            "vocab_size": len(tok), "bos_token_id": b.bos, "eos_token_id": b.eos, "pad_token_id": b.pad,
            "chars_per_token": {d: heldout[d][1] / max(1, sum(map(len, heldout[d][0]))) for d in heldout},
        },
        "target": {"params": num_params(b.target), "train_tokens": b.t_stats["tokens"], "train": b.t_stats,
                   "dims": asdict(p.target)},
        "drafter": {"params": num_params(b.drafter), "train_tokens": b.d_stats["tokens"], "train": b.d_stats,
                    "dims": asdict(p.drafter), "distilled_on": "code"},
        "heldout": {
            "eval_tokens": {d: evals[d]["tokens"] for d in evals},
            "eval_chars": {d: evals[d]["chars"] for d in evals},
            "target": _per_model(evals, "target"),
            "drafter": _per_model(evals, "drafter"),
            "untrained_drafter": {"code": b.untrained},
        },
        "agreement": {d: evals[d]["drafter"]["top1_agreement"] for d in evals},
        "latency": b.latency,
        "continuations": {"tokens": p.continuation_tokens, "prompts": p.continuation_prompts, **b.cont},
        "wall": b.walls,
        "threads": torch.get_num_threads(),
        # False when a wall budget (not the step count) shaped training: the machine was too slow/busy
        "deterministic": not (b.t_stats["time_bound"] or b.d_stats["time_bound"]),
        "versions": _versions(),
    }




def save_pair(built: BuiltPair, path: str | Path) -> Path:
    """Write tokenizer, target, drafter with save_pretrained, then manifest.json (last: it marks completion)."""
    paths = EmbeddedPaths.at(path)
    paths.root.mkdir(parents=True, exist_ok=True)
    built.tokenizer.save_pretrained(str(paths.tokenizer))
    built.target.save_pretrained(str(paths.target))
    built.drafter.save_pretrained(str(paths.drafter))
    atomic_write_text(paths.manifest, json.dumps(built.manifest, indent=2, sort_keys=True))
    return paths.root


def summary_table(manifest: dict) -> str:
    """What `dvi bootstrap --preset tiny` prints."""
    h = manifest["heldout"]
    lat = manifest["latency"]
    cont = manifest.get("continuations", {})
    rows = [
        ("", "target", "drafter"),
        ("params", f"{manifest['target']['params'] / 1e6:.2f}M", f"{manifest['drafter']['params'] / 1e6:.2f}M"),
        ("layers x hidden", f"{manifest['target']['dims']['num_hidden_layers']} x {manifest['target']['dims']['hidden_size']}",
         f"{manifest['drafter']['dims']['num_hidden_layers']} x {manifest['drafter']['dims']['hidden_size']}"),
        ("train tokens", f"{manifest['target']['train_tokens']:,}", f"{manifest['drafter']['train_tokens']:,} (code)"),
    ]
    for d in ("code", "prose"):
        t, dr = h["target"][d], h["drafter"][d]
        rows.append((f"held-out {d} loss", f"{t['loss']:.3f}", f"{dr['loss']:.3f}"))
        rows.append((f"held-out {d} bits/char", f"{t['bits_per_char']:.3f}", f"{dr['bits_per_char']:.3f}"))
    for d in ("code", "prose"):
        rows.append((f"top-1 agreement {d}", "", f"{manifest['agreement'][d]:.3f}"))
    for d in ("code", "prose"):
        if d in cont:
            rows.append((f"distinct-token ratio {d}", f"{cont[d]['target']:.2f}", f"{cont[d]['drafter']:.2f}"))
    rows.append(("decode step (b=1, KV)", f"{lat['target_ms']:.2f} ms", f"{lat['drafter_ms']:.2f} ms"))
    rows.append(("train wall", f"{manifest['wall']['target_s']:.0f} s", f"{manifest['wall']['drafter_s']:.0f} s"))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"embedded pair '{manifest['preset']}' (seed {manifest['seed']}, vocab {manifest['tokenizer']['vocab_size']})"]
    lines += [f"  {a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows]
    lines.append(f"  latency ratio target/drafter: {lat['ratio']:.1f}x")
    lines.append(f"  total build time: {manifest['wall']['total_s']:.0f} s")
    return "\n".join(lines)
