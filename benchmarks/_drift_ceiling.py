"""The drift benchmark's ceiling arm: the bootstrap drafter distilled offline on the drift domain's training text
(the target's greedy replies to its training-split requests, `drift_training_set`; `build_ceiling`)."""

from __future__ import annotations

import argparse
import itertools
import math
import shutil
import time
from pathlib import Path


def drift_training_set(pair_dir: Path, args: argparse.Namespace) -> dict:
    """The target's greedy replies to training-split requests of the drift domain, cut into windows, with its
    states."""
    import torch

    from dvi.data import chat_prompt_stream, sql_prompt_stream
    from dvi.models.embedded import EmbeddedPaths
    from dvi.models.loading import load_causal_lm, load_tokenizer
    from trainers.builds.offline import pack_docs
    from trainers.builds.pretrained_build import greedy_replies
    from trainers.builds.subset_distill import teacher_states

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
    from trainers.builds.offline import TrainSchedule

    sched = TrainSchedule(steps=steps, lr=args.ceiling_lr, warmup=5, progress=False, desc=f"ceiling[{kind}]")
    kw = {"batch": args.ceiling_batch, "seed": args.seed}
    if kind == "separate":
        from trainers.builds.subset_distill import distill_subset

        student = load_causal_lm(src, "cpu", "float32")
        stats = distill_subset(student, target.lm_head.weight, w, s, ids, sched, **kw)
        student.to(torch.bfloat16).save_pretrained(out)
    else:
        from dvi.drafters.eagle import EagleDrafter
        from trainers.builds.eagle_build import EagleData, distill_eagle

        d = EagleDrafter.load(target, src) if saved_kind(src) == "eagle" else EagleDrafter(target)
        stats = distill_eagle(d, EagleData(w, s), ids, sched, **kw)
        d.save(out)
    if draft_vocab_path(p.drafter).is_file():
        shutil.copyfile(draft_vocab_path(p.drafter), draft_vocab_path(out))
    return {**stats, "online_tokens_x5": tokens, "from": str(src)}
