"""Does a tokenizer agree with its model, and is it still the tokenizer it was built as?

A tokenizer is data a library version builds: transformers 5.17 converts SmolLM2's GGUF with eos = bos =
`<|im_start|>` while the model's configs say eos `<|im_end|>` (issue 36 item 10). A server that stops only on
`tokenizer.eos_token_id` then runs past the end of every answer, silently. So:

- `stop_token_ids`: every id that ends a sequence for the model: the tokenizer's eos and the model's
  `generation_config.eos_token_id` (an int or a list: Llama 3 ends on `<|eot_id|>` and `<|end_of_text|>`).
- `special_token_mismatches`: the tokenizer's eos / bos against the model's configs, as warnings that say
  what to do (the server still stops on every eos).
- `tokenizer_digest`: a hash of what the tokenizer *does* (vocabulary, merges, added and special tokens,
  pipeline kinds, chat template, the ids and text of probe strings), per part, independent of how a library
  version serialises it; a converted tokenizer dir keeps the digest it was built with and the library
  versions (`CONVERSION_RECORD`), and `conversion_drift` compares a loaded tokenizer with it.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any

CONVERSION_RECORD = "dvi_conversion.json"
"""Written beside a converted tokenizer (`dvi.models.pretrained.convert_gguf`): versions, digest, special ids."""

PROBES = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "  leading spaces,\ttabs\r\nand trailing   ",
    "The quick brown fox -- naïve café, 12,345.67 km; 東京タワー 🙂 ∑ 𝔘",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
)
"""Strings whose ids and round trip are part of the digest: code, whitespace, non-ASCII, chat markers."""

LIBRARIES = ("transformers", "tokenizers", "gguf", "torch")


def library_versions() -> dict[str, str]:
    """The installed versions of the libraries that build and read tokenizers (None-safe: "absent")."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def config_eos_ids(model: Any) -> tuple[int, ...]:
    """The model's own end-of-sequence ids: its generation config's (what `generate` stops on), else its config's."""
    gen = getattr(model, "generation_config", None)
    ids = _ids(getattr(gen, "eos_token_id", None))
    return ids or _ids(getattr(getattr(model, "config", None), "eos_token_id", None))


def stop_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends a sequence: the tokenizer's eos and the model's eos ids, in that order, once each."""
    ids = _ids(getattr(tokenizer, "eos_token_id", None)) + config_eos_ids(model)
    return tuple(dict.fromkeys(ids))


def _name(tokenizer: Any, tid: int | None) -> str:
    return "none" if tid is None else f"{tokenizer.convert_ids_to_tokens(int(tid))!r} ({tid})"


def special_token_mismatches(tokenizer: Any, model: Any, where: str = "") -> list[str]:
    """Why the tokenizer's eos / bos disagree with the model's configs (empty: they agree); each line says what
    the server does about it and how to fix it."""
    out = []
    model_eos = config_eos_ids(model)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    fix = (f"rebuild the tokenizer{' at ' + where if where else ''} with a supported transformers version, or "
           "fix its special tokens (tokenizer_config.json) to match the model's config.json / generation_config.json")
    if model_eos and tok_eos not in model_eos:
        out.append(f"tokenizer eos is {_name(tokenizer, tok_eos)} but the model's configs say eos "
                   f"{', '.join(_name(tokenizer, i) for i in model_eos)}; dvi stops on all of them; {fix}")
    model_bos = getattr(getattr(model, "config", None), "bos_token_id", None)
    tok_bos = getattr(tokenizer, "bos_token_id", None)
    if model_bos is not None and tok_bos is not None and int(model_bos) != int(tok_bos):
        out.append(f"tokenizer bos is {_name(tokenizer, tok_bos)} but the model's config says bos "
                   f"{_name(tokenizer, model_bos)}; a prompt that starts with the tokenizer's bos starts wrong; {fix}")
    return out


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, ensure_ascii=False, sort_keys=True).encode()).hexdigest()[:16]


def _backend_spec(tokenizer: Any) -> dict[str, Any]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        return json.loads(backend.to_str()) if backend is not None else {}
    except (ValueError, AttributeError):
        return {}


def _part_type(part: dict | None) -> Any:
    """A pipeline part's type, and its members' for a Sequence (their parameters are serialisation detail)."""
    if not part:
        return None
    members = part.get("decoders") or part.get("pretokenizers") or part.get("normalizers") or part.get("processors")
    return [part.get("type"), [_part_type(m) for m in members]] if members else part.get("type")


def tokenizer_digest(tokenizer: Any) -> dict[str, str]:
    """A hash per part of what the tokenizer does, and `all` over the parts (equal digests: same tokenizer)."""
    spec = _backend_spec(tokenizer)
    merges = (spec.get("model") or {}).get("merges") or []
    probes = []
    for text in PROBES:
        ids = tokenizer.encode(text, add_special_tokens=True)
        probes.append([ids, tokenizer.decode(ids, skip_special_tokens=False)])
    parts = {
        "vocab": _sha(sorted(tokenizer.get_vocab().items())),
        "merges": _sha([m if isinstance(m, str) else " ".join(m) for m in merges]),
        "added": _sha(sorted([i, t.content, bool(t.special)] for i, t in tokenizer.added_tokens_decoder.items())),
        "special_ids": _sha({k: getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "unk", "pad")}),
        "pipeline": _sha({k: _part_type(spec.get(k)) for k in ("normalizer", "pre_tokenizer", "decoder", "post_processor")}
                         | {"model": (spec.get("model") or {}).get("type"),
                            "clean_up_tokenization_spaces": bool(getattr(tokenizer, "clean_up_tokenization_spaces",
                                                                         False))}),
        "chat_template": _sha(getattr(tokenizer, "chat_template", None) or ""),
        "probes": _sha(probes),
    }
    return {**parts, "all": _sha(parts)}


def differing_parts(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """The digest parts in which two tokenizers differ (`all` left out)."""
    return [k for k in a if k != "all" and a.get(k) != b.get(k)]


def read_conversion_record(tokenizer_dir: str | Path) -> dict | None:
    """The record a conversion left beside the tokenizer, or None (not converted by dvi, or unreadable)."""
    try:
        return json.loads((Path(tokenizer_dir) / CONVERSION_RECORD).read_text())
    except (OSError, ValueError):
        return None


def conversion_drift(tokenizer: Any, tokenizer_dir: str | Path) -> list[str]:
    """Warnings when a converted tokenizer no longer loads as it was built (another transformers / tokenizers
    reads its files differently); empty without a record or when it matches."""
    record = read_conversion_record(tokenizer_dir)
    built = (record or {}).get("tokenizer_digest")
    if not built:
        return []
    parts = differing_parts(built, tokenizer_digest(tokenizer))
    if not parts:
        return []
    then, now = record.get("libraries", {}), library_versions()
    return [f"the tokenizer at {tokenizer_dir} loads differently from how it was built ({', '.join(parts)} differ; "
            f"built with transformers {then.get('transformers')} / tokenizers {then.get('tokenizers')}, loaded with "
            f"{now['transformers']} / {now['tokenizers']}): install the versions it was built with, or rebuild it "
            "(remove the pair's directory and run `dvi bootstrap` again)"]
