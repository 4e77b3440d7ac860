"""Data for `benchmarks/drafter_ceiling.py`: the target's own text and states, computed once and cached on disk.

Training (what the build can see): windows of stdlib code and pydoc prose (train split), the target's greedy
replies to train-split chat instructions and its greedy continuations of train-split code cuts (self-distillation:
the text a served drafter drafts on). Evaluation (what no build saw): cuts of pip's installed source and chat
instructions written for this benchmark, each followed by the target's greedy continuation, so a draft chain's
acceptance is exact (the text after position j *is* the target's greedy choice).

Everything is labelled by the fp32 lean forward (`trainers.builds.target_features`), in chunks saved as they finish, so
an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import itertools
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks._prompts import def_cuts, pip_code_prompts
from trainers.builds.target_features import TargetStates, target_states

CHAT_EVAL = [
    "Write a short poem about a snail crossing a garden path at dawn.",
    "Explain what a hash table is and why lookups are usually fast.",
    "Give me three ideas for a rainy Sunday afternoon with two young children.",
    "What should I check before buying a used bicycle? Answer in a short list.",
    "Describe how bread rises, for someone who has never baked.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Summarize the rules of tic-tac-toe in three sentences.",
    "How can I make my morning routine less rushed? Give four tips.",
    "Write a polite message asking a neighbour to turn down loud music at night.",
    "What is the difference between weather and climate?",
    "Explain recursion to a beginner programmer with a simple example.",
    "Suggest a three-course vegetarian dinner menu for a birthday.",
    "Why do cats purr? Keep the answer short.",
    "Write a short story opening about a clockmaker who finds a door in her workshop.",
    "List five common mistakes people make when learning a new language.",
    "How does compound interest work? Use a numeric example.",
    "Write a bash command that counts the lines in every .txt file in a folder.",
    "What are the benefits of regular stretching?",
    "Compose a thank-you note to a teacher at the end of the school year.",
    "Explain the difference between a process and a thread.",
    "Describe a sunrise over the mountains in three sentences.",
    "Give me a simple weekly plan to start running from zero.",
    "What is a prime number? Give a few examples and one fun fact.",
    "Write a JavaScript function that reverses a string.",
]


@dataclass
class EvalSet:
    """Sequences (prompt + the target's greedy continuation), the first position each is scored from (the
    prompt's last: the first draft step follows the prefill), and the target's states on them."""

    seqs: list[list[int]]
    starts: list[int]
    states: TargetStates


def stdlib_code_prompts(tok, n: int, seed: int) -> list[list[int]]:
    """Cuts of train-split stdlib code (the build's own text), shaped like `pip_code_prompts`."""
    from dvi import data

    rng = random.Random(f"ceiling-train/{seed}")
    texts = data.load_texts("code", "train")
    return def_cuts((rng.choice(texts) for _ in iter(int, 1)), rng, tok, n)


def _cached(path: Path, make):
    if path.exists():
        return torch.load(path, weights_only=False)
    t0 = time.perf_counter()
    value = make()
    tmp = path.with_suffix(".tmp")
    torch.save(value, tmp)
    tmp.replace(path)
    print(f"[ceiling] {path.name}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return value


def _greedy(target, tok, prompts: list[list[int]], new: int, desc: str) -> list[list[int]]:
    from trainers.builds.pretrained_build import greedy_replies

    return greedy_replies(target, tok, prompts, new, batch=8, progress=True, desc=desc)


def eval_sets(target, tok, cache: Path, layers: tuple[int, ...], n: int = 24) -> dict[str, EvalSet]:
    """code: pip cuts + 64 greedy tokens; chat: `CHAT_EVAL` rendered + a greedy reply of up to 128 tokens."""
    from dvi import data

    out = {}
    for dom in ("code", "chat"):
        if dom == "code":
            prompts = pip_code_prompts(tok, n, seed=1)
            new = 64
        else:
            prompts = [data.render_chat(tok, [{"role": "user", "content": c}]) for c in CHAT_EVAL[:n]]
            new = 128
        seqs = _cached(cache / f"eval_{dom}_seqs.pt", lambda p=prompts, k=new, d=dom: _greedy(target, tok, p, k, d))
        tag = "-".join(map(str, layers))
        states = _cached(cache / f"eval_{dom}_states_{tag}.pt",
                         lambda s=seqs, d=dom: target_states(target, s, layers, progress=True, desc=f"eval {d}"))
        out[dom] = EvalSet(seqs, [len(p) - 1 for p in prompts], states)
    return out


def train_streams(target, tok, cache: Path, chat_n: int, code_n: int) -> dict[str, torch.Tensor]:
    """Packed token streams: stdlib code and pydoc prose (text), the target's chat replies and code continuations."""
    from dvi import data
    from trainers.builds.offline import pack_docs

    def enc(texts):
        return [e.ids for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]

    chat_prompts = list(itertools.islice(data.chat_prompt_stream(tok, "train", seed=0, max_tokens=320), chat_n))
    chats = _cached(cache / f"train_chat_{chat_n}.pt", lambda: _greedy(target, tok, chat_prompts, 160, "train chat"))
    code_prompts = stdlib_code_prompts(tok, code_n, seed=0)
    code = _cached(cache / f"train_code_greedy_{code_n}.pt",
                   lambda: _greedy(target, tok, code_prompts, 96, "train code"))
    eos = tok.eos_token_id
    return {"code_text": pack_docs(enc(data.load_texts("code", "train")), None, eos),
            "prose": pack_docs(enc(data.load_texts("prose", "train")), None, eos),
            "chat": pack_docs(chats, None, None), "code_greedy": pack_docs(code, None, eos)}


def train_windows(streams: dict[str, torch.Tensor], n: int, seq_len: int, mix: dict[str, float],
                  seed: int = 0) -> torch.Tensor:
    """n windows [n, seq_len + 1]: disjoint cuts of each stream, as many per stream as its `mix` share asks (the
    generated streams are small: all of their windows), shuffled."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for name, share in mix.items():
        s = streams[name]
        cuts = s[: (s.numel() // (seq_len + 1)) * (seq_len + 1)].view(-1, seq_len + 1)
        want = min(cuts.shape[0], round(n * share))
        rows.append(cuts[torch.randperm(cuts.shape[0], generator=g)[:want]])
    out = torch.cat(rows)
    return out[torch.randperm(out.shape[0], generator=g)]


def train_states(target, windows: torch.Tensor, cache: Path, layers: tuple[int, ...], chunk: int = 32,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(layers [N, T, len * H], final [N, T, H], top [N, T]) on windows[:, :-1], labelled `chunk` windows at a time
    (each chunk cached)."""
    tag = "-".join(map(str, layers))
    parts = []
    for i in range(0, windows.shape[0], chunk):
        w = windows[i: i + chunk]
        key = f"{int(w.sum())}-{w.shape[0]}"  # the windows' identity (a change of recipe relabels)
        parts.append(_cached(cache / f"train_states_{tag}_{i // chunk:04d}_{key}.pt",
                             lambda w=w, i=i: target_states(target, w[:, :-1], layers, progress=False)))
        print(f"[ceiling] labelled {min(i + chunk, windows.shape[0])}/{windows.shape[0]} windows", file=sys.stderr,
              flush=True)
    return (torch.cat([p.layers for p in parts]), torch.cat([p.final for p in parts]),
            torch.cat([p.top for p in parts]))
