from __future__ import annotations

import pytest

from dvi import data


def test_code_files_exclude_tests_and_third_party():
    files = data.code_files()
    assert len(files) > 300
    assert list(files) == sorted(files)
    for f in files:
        parts = f.split("/")
        assert f.endswith(".py")
        assert not {"test", "tests", "idle_test", "site-packages", "idlelib", "encodings"} & set(parts[:-1])
    assert "os.py" in files and "json/decoder.py" in files


@pytest.mark.parametrize("domain", data.DOMAINS)
def test_split_is_disjoint_and_complete(domain):
    train = data.doc_names(domain, "train")
    held = data.doc_names(domain, "heldout")
    assert held and train
    assert not set(train) & set(held)
    allnames = data.code_files() if domain == "code" else tuple(data.prose_topics())
    assert set(train) | set(held) == set(allnames)
    assert 0.03 < len(held) / len(allnames) < 0.25


def test_split_is_per_name_and_stable():
    names = [f"pkg/mod{i}.py" for i in range(200)]
    train, held = data.split_files(names)
    # dropping other names never moves a name between splits
    t2, h2 = data.split_files(names[:50])
    assert set(h2) == set(held) & set(names[:50])
    assert set(t2) == set(train) & set(names[:50])


def test_heldout_texts_never_in_train():
    for domain in data.DOMAINS:
        train = set(data.load_texts(domain, "train"))
        held = data.held_out_docs(domain)
        assert held
        assert not train & set(held)


def test_bad_domain_or_split():
    with pytest.raises(ValueError, match="domain"):
        data.load_texts("poetry", "train")
    with pytest.raises(ValueError, match="split"):
        data.load_texts("code", "test")


def test_corpus_stats_shape():
    s = data.corpus_stats()
    for d in data.DOMAINS:
        for sp in data.SPLITS:
            assert s[d][sp]["files"] > 0 and s[d][sp]["chars"] > 0
    assert s["code"]["train"]["chars"] > 1_000_000


def test_prompt_stream_deterministic_and_in_range(tiny_pair_dir):
    from dvi.models.loading import load_tokenizer

    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    a = data.prompt_stream("code", tok, prompt_tokens=(8, 16), seed=3)
    b = data.prompt_stream("code", tok, prompt_tokens=(8, 16), seed=3)
    pa = [next(a) for _ in range(20)]
    pb = [next(b) for _ in range(20)]
    assert pa == pb
    assert all(8 <= len(p) <= 16 for p in pa)
    assert all(isinstance(t, int) and 0 <= t < len(tok) for p in pa for t in p)
    c = data.prompt_stream("code", tok, prompt_tokens=(8, 16), seed=4)
    assert [next(c) for _ in range(20)] != pa
    # prompts come from held-out text
    held = "".join(data.held_out_docs("prose"))
    p = next(data.prompt_stream("prose", tok, prompt_tokens=(4, 4), seed=0))
    assert tok.decode(p) in held


def _sql_tables(msgs: list[dict]) -> set[str]:
    import re

    return set(re.findall(r"CREATE TABLE (\w+)", msgs[0]["content"]))


def test_sql_split_by_theme_never_overlaps_and_is_deterministic():
    """The new domain's held-out requests never name a table (theme) the train split uses, and the
    same seed gives the same requests."""
    import itertools

    train = set().union(*(_sql_tables(m) for m in itertools.islice(data.sql_instructions("train", 0), 300)))
    held = set().union(*(_sql_tables(m) for m in itertools.islice(data.sql_instructions("heldout", 0), 300)))
    assert train and held and not train & held
    assert train | held == set(data.SQL_THEMES)
    a = list(itertools.islice(data.sql_instructions("heldout", 3), 5))
    assert a == list(itertools.islice(data.sql_instructions("heldout", 3), 5))
    assert a != list(itertools.islice(data.sql_instructions("heldout", 4), 5))
    with pytest.raises(ValueError, match="split"):
        next(data.sql_instructions("dev"))


def test_sql_requests_use_the_schema_columns():
    """Every request names columns of a table it shows: numeric work on REAL columns, text on TEXT ones."""
    import itertools
    import re

    for msgs in itertools.islice(data.sql_instructions("train", 1), 200):
        text = msgs[0]["content"]
        request = text.split("Write one SQL query:")[1]
        cols = {c.split()[0] for t in _sql_tables(msgs) for c in data.SQL_THEMES[t]} | {"id"}
        named = set(re.findall(r"\b([a-z]+(?:_[a-z]+)+|[a-z]+)\b", request)) & {
            c.split()[0] for t in data.SQL_THEMES.values() for c in t}
        assert named <= cols, (request, named - cols)
        avg = re.search(r"average (\w+)", request)
        if avg:
            assert any(c == f"{avg.group(1)} REAL" for t in _sql_tables(msgs) for c in data.SQL_THEMES[t])


def test_sql_prompt_stream_renders_and_bounds(tiny_pair_dir):
    import itertools

    from dvi.models.loading import load_tokenizer

    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    ids = list(itertools.islice(data.sql_prompt_stream(tok, "heldout", seed=0, max_tokens=200), 4))
    assert len(ids) == 4 and all(0 < len(x) <= 200 for x in ids)
    assert "CREATE TABLE" in tok.decode(ids[0])
def test_agentic_instructions_repeat_a_few_functions_deterministically():
    import itertools

    from dvi.data import AGENTIC_EDITS, agentic_instructions

    first = [m[0]["content"] for m in itertools.islice(agentic_instructions(seed=1), 40)]
    assert first == [m[0]["content"] for m in itertools.islice(agentic_instructions(seed=1), 40)]
    funcs = {x.split("```python")[1].split("```")[0] for x in first}
    assert len(funcs) <= 12 and len(funcs) < len(first) // 2          # functions recur: history repeats
    assert all(any(e in x for e in AGENTIC_EDITS) for x in first)
    with pytest.raises(ValueError, match="split"):
        next(agentic_instructions("nope"))
