"""Which model pair the server serves, and building it when it is missing.

Its own module because it is the one part of serving that reads `cfg.models` and touches model
files: `serving.app` calls it once at startup, `dvi demo` and the load benchmark call it to
bootstrap the embedded pair, and none of them need the HTTP layer to do so.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dvi.config import DviConfig

if TYPE_CHECKING:
    from dvi.models.loading import ModelPair

log = logging.getLogger("dvi.serving")


def pair_paths(cfg: DviConfig) -> tuple[Path, Path | None, Path | None]:
    """(target, drafter, tokenizer) paths: the config's, else the embedded preset's."""
    from dvi.models.embedded import embedded_paths

    m = cfg.models
    if m.target is not None:
        return Path(m.target), (Path(m.drafter) if m.drafter else None), (Path(m.tokenizer) if m.tokenizer else None)
    p = embedded_paths(m.preset)
    return p.target, (Path(m.drafter) if m.drafter else p.drafter), (Path(m.tokenizer) if m.tokenizer else p.tokenizer)


def ensure_pair(cfg: DviConfig) -> None:
    """Bootstrap the embedded pair in a subprocess if the config uses it and it is not built.

    A subprocess, because serving must not import trainers (DESIGN.md import arrows).
    """
    from dvi.models.embedded import PretrainedPreset, built_kinds, embedded_dir, get_preset, is_built

    m = cfg.models
    if m.target is not None:
        return
    preset, learned = m.preset, m.learned_kind  # `suffix`: no learned drafter; `hybrid`: its `hybrid_kind`
    # a learned kind beside `separate` is built on demand for a pretrained pair when no drafter dir is configured;
    # the pair itself (target, tokenizer, `separate`) is what every kind, `suffix` included, needs first
    want = learned if learned not in (None, "separate") and m.drafter is None \
        and isinstance(get_preset(preset), PretrainedPreset) else "separate"
    if is_built(embedded_dir(preset), preset) and want in built_kinds(embedded_dir(preset)):
        return
    cmd = [sys.executable, "-m", "dvi.cli", "bootstrap", "--preset", preset, "--kinds", want]
    log.warning("embedded pair %r has no trained %s drafter yet; running `dvi bootstrap --preset %s --kinds %s` "
                "(minutes on a CPU)", preset, want, preset, want)
    subprocess.run(cmd, check=True)


def load_serving_pair(cfg: DviConfig, target_weights: bool = True) -> ModelPair:
    """The `ModelPair` to serve; its drafter is of `models.learned_kind` (`hybrid`: its `hybrid_kind`; `suffix`:
    none, the engine's proposer is built from the config, `dvi.drafters.suffix_proposer.make_proposer`).

    `target_weights=False` (a server whose engine has a process of its own): the target without its weights
    (`dvi.models.loading.load_causal_lm_shape`): that process only reads its configs and shapes, so it never holds
    a copy of the target's weights beside the engine's. early_exit / eagle draft on the target's own layers: their
    pair loads whole.

    separate: the drafter dir's HF model (reduced head if it has a draft vocabulary);
    early_exit / eagle: an `EarlyExitDrafter` / `EagleDrafter` on the loaded target
    (`dvi.models.loading.load_shared_target_drafter`, the same one the online trainer builds, so its published
    versions fit).
    """
    from dvi.decode.numerics import set_exact_greedy
    from dvi.models.loading import draft_vocab_size_for, load_pair, load_shared_target_drafter, serving_dtype

    m = cfg.models
    target_path, drafter_path, tok_path = pair_paths(cfg)
    early = m.learned_kind in ("early_exit", "eagle")
    dtype = m.dtype if m.target is not None else serving_dtype(m.preset, m.dtype, m.device)
    if cfg.serve.engine == "vllm" and m.dtype == "auto":
        # the pair dvi exports to vLLM (and checks vLLM's greedy text against) in the dtype vLLM serves: float32 on
        # a CPU. The embedded pair's own `auto` is bf16 on a bf16-native CPU (AVX512-BF16, AMX), whose rounded
        # weights vLLM would then serve in float32 (issue 60: greedy tokens changed against the checkpoint's)
        from .vllm_process import VllmProcess

        dtype = VllmProcess.resolve_dtype(cfg.serve.vllm.dtype)
    pair = load_pair(target_path, None if early or m.learned_kind is None else drafter_path, tok_path, device=m.device, dtype=dtype,
                     draft_vocab_size=draft_vocab_size_for(m), draft_vocab=m.draft_vocab,
                     target_weights=target_weights or early)
    set_exact_greedy(pair.target, m.exact_greedy)
    if early:
        pair.drafter = load_shared_target_drafter(pair.target, target_path, cfg)
    return pair


def serving_proposer(cfg: DviConfig, pair: ModelPair):
    """The engine's proposer, by `models.drafter_kind` (`dvi.drafters.factory.make_proposer`): the pair's learned
    drafter, or for `suffix` / `hybrid` the proposer over a `SuffixCache` bounded by `cfg.suffix` (hybrid: around
    the learned drafter); `none` when speculation is off."""
    from dvi.drafters.factory import make_proposer

    spec, m = cfg.speculation, cfg.models
    name = "none" if spec.num_draft_tokens == 0 and not spec.adaptive else m.drafter_kind
    vocab = int(pair.target.get_output_embeddings().weight.shape[0])
    device = next(pair.target.parameters()).device
    return make_proposer(name, pair.drafter, vocab, device, settings=cfg.suffix)
