"""Loading any Hugging Face causal-LM pair (target + drafter + tokenizer) from paths.

The embedded pair and a user's own checkpoints go through the same `from_pretrained` calls, so
nothing downstream knows which it got. `check_compatible` refuses pairs that cannot speculate
for each other (different vocabularies), with a message that says why. `load_state_dict` and
`check_target_state_dict` read and vet new target weights (`SpeculativeEngine.update_target_weights`).
`load_pair` also says (logs, and keeps in `ModelPair.warnings`) where the tokenizer's eos / bos disagree with
the target's configs or where it no longer loads as it was converted (`dvi.models.tokenizer_check`).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from dvi.decode.numerics import cpu_flags, set_exact_greedy
from dvi.drafters.vocab import apply_draft_vocab, load_draft_vocab
from dvi.models.tokenizer_check import conversion_drift, special_token_mismatches, stop_token_ids

log = logging.getLogger("dvi.models")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class IncompatibleModelsError(ValueError):
    """Target and drafter cannot be used together (vocab or tokenizer mismatch)."""


@dataclass
class ModelPair:
    """A target, an optional drafter and the tokenizer they share; `stop_ids`: every id that ends a sequence
    (the tokenizer's eos and the target's configured ones); `warnings`: how the tokenizer disagrees with the
    target's configs or with how it was built (`dvi.models.tokenizer_check`), each already logged."""

    target: Any
    drafter: Any | None
    tokenizer: Any
    stop_ids: tuple[int, ...] = ()
    warnings: list[str] = field(default_factory=list)


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """'auto' -> cuda if available, else mps, else cpu; anything else is passed to torch.device."""
    if device is None or str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"invalid device {device!r}: {e}") from None


def resolve_dtype(dtype: str | torch.dtype | None = "auto", device: str | torch.device | None = "cpu") -> torch.dtype:
    """'auto' -> float32 on CPU (no fast half kernels here), bfloat16 on GPUs that support it, else float16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        dev = resolve_device(device)
        if dev.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if dev.type == "mps":
            return torch.float16
        return torch.float32
    key = str(dtype).removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ValueError(f"invalid dtype {dtype!r}; expected 'auto' or one of {sorted(set(_DTYPES))}")
    return _DTYPES[key]


# `DVI_CPU_BF16=1` / `=0` overrides the CPU's own answer, so a test (or CI on a CPU without native bf16) runs the
# paths a bf16-native CPU selects (PyTorch emulates bf16 there: slower, same results), and the other way round.
CPU_BF16_ENV = "DVI_CPU_BF16"


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bf16 natively (AVX512-BF16 or AMX), or `$DVI_CPU_BF16` says to act as if:
    there a memory-bound decode step of a real LM runs faster in bf16 and a (K+1)-token verify costs about one
    step (docs/design.md, "Cost shape")."""
    import os

    forced = os.environ.get(CPU_BF16_ENV, "").strip()
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"${CPU_BF16_ENV} must be 1 (act as a bf16-native CPU) or 0 (as one without), "
                             f"got {forced!r}")
        return forced == "1"
    return _cpu_flags_have_bf16()


@lru_cache(maxsize=1)
def _cpu_flags_have_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def serving_dtype(preset: str, dtype: str, device: str | torch.device = "auto") -> str:
    """`models.dtype` as served for an embedded preset: "auto" becomes the preset's measured serving
    dtype (bf16 for the real pretrained pair on a CPU with native bf16); anything else is kept."""
    from dvi.models.embedded import PretrainedPreset, get_preset

    if dtype != "auto" or not isinstance(get_preset(preset), PretrainedPreset):
        return dtype
    if resolve_device(device).type == "cpu" and not cpu_has_native_bf16():
        return "float32"
    return "bfloat16"


def draft_vocab_size_for(models_cfg) -> int | None:
    """`models.draft_vocab_size`, or for the embedded pretrained pair (no paths of one's own) its measured
    serving default (`PretrainedPreset.serve_draft_vocab`)."""
    size = getattr(models_cfg, "draft_vocab_size", None)
    own = [getattr(models_cfg, k, None) for k in ("target", "drafter", "draft_vocab")]
    if size is not None or any(x is not None for x in own):
        return size
    return preset_draft_vocab(models_cfg.preset)


def preset_draft_vocab(preset: str) -> int | None:
    """The draft vocabulary size an embedded preset serves by default (None: every stored id)."""
    from dvi.models.embedded import PretrainedPreset, get_preset

    p = get_preset(preset)
    return p.serve_draft_vocab if isinstance(p, PretrainedPreset) else None


def load_causal_lm(path: str | Path, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto"):
    """`AutoModelForCausalLM.from_pretrained(path)` on `device` in `dtype`, in eval mode."""
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if not Path(path).exists() and not _looks_like_hub_id(path):
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt)
    return model.to(dev).eval()


def load_causal_lm_shape(path: str | Path):
    """The model `load_causal_lm` would load, built on the meta device from its configs: every config and
    parameter shape, no weights. For a process that reads what the target is (its vocabulary rows, eos ids,
    context) but never runs it: a server whose engine loads the target in a process of its own."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if not Path(path).exists() and not _looks_like_hub_id(path):
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    try:
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    except OSError:  # no generation_config.json: the config's eos ids serve, as `from_pretrained` leaves them
        pass
    return model.eval()


def _looks_like_hub_id(path: str | Path) -> bool:
    s = str(path)
    return not s.startswith(("/", ".", "~")) and s.count("/") == 1


def _has_tokenizer(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and any((p / f).exists() for f in _TOKENIZER_FILES)


def find_tokenizer_path(model_path: str | Path) -> Path:
    """The model dir itself if it holds a tokenizer, else a sibling `tokenizer/` (the embedded layout)."""
    p = Path(model_path)
    if _has_tokenizer(p):
        return p
    if _has_tokenizer(p.parent / "tokenizer"):
        return p.parent / "tokenizer"
    return p


def load_tokenizer(path: str | Path):
    """`AutoTokenizer.from_pretrained(path)`; a pad token is set (eos) if the tokenizer lacks one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def _vocab_rows(model) -> int:
    emb = model.get_output_embeddings()
    if emb is not None and getattr(emb, "weight", None) is not None:
        return int(emb.weight.shape[0])
    return int(model.config.vocab_size)


def check_compatible(target, drafter, tokenizer, drafter_tokenizer=None) -> None:
    """Raise IncompatibleModelsError unless the drafter can propose tokens the target verifies.

    Both models must have the same output vocabulary size, the tokenizer must fit in it, and a
    drafter tokenizer (if it has its own) must map the same strings to the same ids.
    """
    t_rows = _vocab_rows(target)
    n_tok = len(tokenizer) if tokenizer is not None else 0
    if tokenizer is not None and n_tok > t_rows:
        raise IncompatibleModelsError(
            f"tokenizer has {n_tok} tokens but the target's vocabulary has only {t_rows} rows; "
            "they were not trained together"
        )
    if drafter is None:
        return
    d_rows = _vocab_rows(drafter)
    if d_rows != t_rows:
        raise IncompatibleModelsError(
            f"vocab size mismatch: target has {t_rows} output tokens, drafter has {d_rows}; "
            "a drafter must share the target's tokenizer and vocabulary"
        )
    if drafter_tokenizer is not None and tokenizer is not None:
        if drafter_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise IncompatibleModelsError(
                "tokenizer mismatch: the drafter's tokenizer maps tokens to different ids than the "
                "target's; a drafter must share the target's tokenizer"
            )


def load_pair(
    target_path: str | Path,
    drafter_path: str | Path | None = None,
    tokenizer_path: str | Path | None = None,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    draft_vocab_size: int | None = None,
    draft_vocab: str | Path | None = None,
    target_weights: bool = True,
) -> ModelPair:
    """Load target (+ drafter) + tokenizer from paths and check that they fit together.

    `target_weights=False`: the target without its weights (`load_causal_lm_shape`), for a process that only reads
    its configs and shapes; the same checks run.

    The tokenizer comes from `tokenizer_path`, else from the target dir, else from a sibling
    `tokenizer/` dir (the embedded layout). If the drafter dir holds its own tokenizer it must
    match the target's. A `draft_vocab.safetensors` in the drafter dir (or at `draft_vocab`) gives the
    drafter a reduced draft vocabulary, sized by `draft_vocab_size` (see `dvi.drafters.vocab.load_draft_vocab`).
    """
    tok_path = tokenizer_path if tokenizer_path is not None else find_tokenizer_path(target_path)
    tokenizer = load_tokenizer(tok_path)
    target = load_causal_lm(target_path, device, dtype) if target_weights else load_causal_lm_shape(target_path)
    drafter = drafter_tok = None
    if drafter_path is not None:
        drafter = load_causal_lm(drafter_path, device, dtype)
        if _has_tokenizer(drafter_path) and Path(drafter_path).resolve() != Path(tok_path).resolve():
            drafter_tok = load_tokenizer(drafter_path)
    check_compatible(target, drafter, tokenizer, drafter_tok)
    if drafter is not None:
        ids = load_draft_vocab(draft_vocab or drafter_path, draft_vocab_size, _vocab_rows(target))
        if ids is not None:
            apply_draft_vocab(drafter, ids)
    warnings = special_token_mismatches(tokenizer, target, str(tok_path)) + conversion_drift(tokenizer, tok_path)
    for w in warnings:
        log.warning("%s", w)
    return ModelPair(target=target, drafter=drafter, tokenizer=tokenizer, stop_ids=stop_token_ids(target, tokenizer),
                     warnings=warnings)


def load_shared_target_drafter(target, target_path: str | Path, cfg):
    """The drafter of `models.learned_kind` that runs on `target`'s own weights (early_exit, eagle).

    `models.drafter`, when it is a saved dir of that kind (`EarlyExitDrafter.save()` / `EagleDrafter.save()`),
    is loaded as is (another kind's dir there is ignored), else the embedded pair's `early_exit/` or `eagle/`
    dir when it was built; otherwise a fresh one is built (early exit: `models.early_exit_layers` and the
    trainer's LoRA settings), what the online trainer builds too, so its published versions fit. Its draft
    vocabulary comes from `models.draft_vocab`, else the saved dir, else (embedded pair) the separate
    drafter's, else the target dir.
    """
    from dvi.drafters.eagle import EagleDrafter
    from dvi.drafters.learned import EarlyExitDrafter
    from dvi.drafters.vocab import draft_vocab_path
    from dvi.models.embedded import embedded_paths

    m, t = cfg.models, cfg.trainer
    kind = m.learned_kind
    built = getattr(embedded_paths(m.preset), kind)
    saved = Path(m.drafter) if m.drafter is not None and saved_kind(Path(m.drafter)) == kind else None
    if saved is None and m.drafter is None and m.target is None and saved_kind(built) == kind:
        saved = built  # the one the embedded pair's bootstrap trained
    embedded = embedded_paths(m.preset).drafter if m.target is None else None
    if embedded is not None and not draft_vocab_path(embedded).is_file():
        embedded = None
    ids = load_draft_vocab(m.draft_vocab or saved or embedded or target_path, draft_vocab_size_for(m),
                           _vocab_rows(target))
    cls = {"early_exit": EarlyExitDrafter, "eagle": EagleDrafter}[kind]
    if saved is not None:
        return cls.load(target, saved, vocab_ids=ids)
    if kind == "eagle":
        return EagleDrafter(target, vocab_ids=ids)
    return EarlyExitDrafter(target, m.early_exit_layers, lora_rank=t.lora_rank, lora_alpha=int(t.lora_alpha),
                            target_modules=list(t.lora_targets), vocab_ids=ids)


def saved_kind(path: Path) -> str | None:
    """The `dvi_kind` of a saved target-sharing drafter dir (early_exit, eagle), or None."""
    import json

    from dvi.drafters.learned import ADAPTER_CONFIG

    try:
        return json.loads((path / ADAPTER_CONFIG).read_text()).get("dvi_kind")
    except (OSError, ValueError, AttributeError):
        return None


def load_embedded_pair(preset: str = "tiny", root: str | Path | None = None, device="auto", dtype="auto",
                       draft_vocab_size: int | None = None) -> ModelPair:
    """The built embedded pair of `preset` (see `trainers.builds.bootstrap` / `dvi bootstrap`), served as its preset
    says unless told otherwise (dtype "auto", draft vocabulary size None)."""
    from dvi.models.embedded import embedded_paths, is_built

    p = embedded_paths(preset, root)
    if not is_built(p.root):
        raise FileNotFoundError(f"embedded pair {preset!r} not built at {p.root}; run `dvi bootstrap --preset {preset}`")
    size = draft_vocab_size if draft_vocab_size is not None else preset_draft_vocab(preset)
    return load_pair(p.target, p.drafter, p.tokenizer, device=device, dtype=serving_dtype(preset, dtype, device),
                     draft_vocab_size=size)


def num_params(model) -> int:
    """Parameter count (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@torch.inference_mode()
def decode_step_latency(model, steps: int = 64, prompt_len: int = 32, warmup: int = 8, seed: int = 0) -> float:
    """Median seconds of one batch-1, KV-cached decode step (HF forward + DynamicCache).

    This is the per-token cost speculative decoding trades against; on CPU it is dominated by
    per-layer overhead, not FLOPs.
    """
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(model.config.vocab_size), (1, prompt_len), generator=g).to(dev)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    tok = out.logits[:, -1:].argmax(-1)
    times = []
    for i in range(warmup + steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def load_pair_from_config(models_cfg) -> ModelPair:
    """`load_pair` from a `ModelsConfig`-like object: its paths, else the embedded preset's (must be built);
    the target is marked for `models.exact_greedy` (dvi.decode.numerics)."""
    from dvi.models.embedded import embedded_paths, is_built

    target, drafter, tok = models_cfg.target, models_cfg.drafter, models_cfg.tokenizer
    device, dtype = getattr(models_cfg, "device", "auto"), getattr(models_cfg, "dtype", "auto")
    if target is None:
        p = embedded_paths(models_cfg.preset)
        if not is_built(p.root):
            raise FileNotFoundError(
                f"embedded pair {models_cfg.preset!r} not built at {p.root}; run `dvi bootstrap --preset {models_cfg.preset}`")
        target, drafter, tok = p.target, drafter or p.drafter, tok or p.tokenizer
        dtype = serving_dtype(models_cfg.preset, dtype, device)
    pair = load_pair(target, drafter, tok, device=device, dtype=dtype,
                     draft_vocab_size=draft_vocab_size_for(models_cfg),
                     draft_vocab=getattr(models_cfg, "draft_vocab", None))
    set_exact_greedy(pair.target, getattr(models_cfg, "exact_greedy", False))
    return pair


def check_target_state_dict(sd: dict, own: dict, complete: bool) -> None:
    """Refuse weights that would break the target: not a state dict, unknown keys, wrong shapes, NaN/inf,
    missing tensors (with `complete`)."""
    if not isinstance(sd, dict) or not sd:
        raise ValueError("state_dict_or_path must be a non-empty state dict or a path to one")
    unexpected = [k for k in sd if k not in own]
    if unexpected:
        raise ValueError(f"state_dict_or_path has keys the target does not: {unexpected[:5]}")
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"state_dict_or_path: {k} is not a tensor")
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"state_dict_or_path: shape of {k} is {tuple(v.shape)}, expected {tuple(own[k].shape)}")
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise ValueError(f"state_dict_or_path: {k} has non-finite values (NaN or inf)")
    if complete:
        present = {own[k].data_ptr() for k in sd}
        missing = [k for k in own if k not in sd and own[k].data_ptr() not in present]
        if missing:
            raise ValueError(f"state_dict_or_path is partial: it lacks {len(missing)} of the target's tensors, "
                             f"e.g. {missing[:3]}")


def weight_files(path: str | Path, confine: Callable[[Path], Path] | None = None) -> list[Path]:
    """The files `load_state_dict(path)` opens: `path` itself, or an HF model directory's shards as its
    index (`model.safetensors.index.json` / `pytorch_model.bin.index.json`) lists them, or its single
    weights file. `confine(p)` sees every file before it is opened (the index before it is read) and
    returns the path to open or raises: the admin API's check that no file lies outside its allowed
    dirs, whatever `../` names or symlinks the directory holds."""
    from transformers.utils import (
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    check = confine or (lambda p: p)
    path = Path(path)
    if path.is_file():
        return [check(path)]
    if not path.is_dir():
        raise ValueError(f"state_dict_or_path: {path} does not exist")
    index = next((path / n for n in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME) if (path / n).is_file()), None)
    if index is not None:
        weight_map = json.loads(check(index).read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f for f in weight_map.values()):
            raise ValueError(f"state_dict_or_path: {index} has no weight_map of tensor name -> shard file")
        return [check(path / f) for f in sorted(set(weight_map.values()))]
    single = next((path / n for n in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME) if (path / n).is_file()), None)
    if single is None:
        raise ValueError(f"state_dict_or_path: {path} holds no {SAFE_WEIGHTS_NAME}, {WEIGHTS_NAME} or a shard "
                         f"index ({SAFE_WEIGHTS_INDEX_NAME}); give a weights file or a save_pretrained directory")
    return [check(single)]


def load_state_dict(path: str | Path, confine: Callable[[Path], Path] | None = None) -> dict[str, torch.Tensor]:
    """Weights from one checkpoint file, or from an HF model directory laid out as `save_pretrained`
    writes it (`weight_files`; `confine` vets every file before it is opened). Files are read by
    transformers' own loader (safetensors, or a weights-only torch pickle)."""
    from transformers.modeling_utils import load_state_dict as read_checkpoint

    sd: dict[str, torch.Tensor] = {}
    for f in weight_files(path, confine):
        sd.update(read_checkpoint(str(f)))
    return sd
