"""Shared fixtures. `tiny_pair_dir`: the tiny embedded pair, bootstrapped once per test session;
`allowed_dir`: a module's admin-path sandbox."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory) -> Path:
    """Path of a built tiny pair (`<dir>/{tokenizer,target,drafter}/`, `manifest.json`).

    Built into the session's tmp dir (~15 s), or reused from `$DVI_TEST_CACHE/tiny` when that
    env var is set (the manifest's recipe fingerprint guards against stale builds).
    """
    from trainers.builds.bootstrap import bootstrap

    cache = os.environ.get("DVI_TEST_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("dvi-models")
    return bootstrap("tiny", out=root / "tiny", seed=0, progress=False)


@pytest.fixture(scope="module")
def allowed_dir(tmp_path_factory) -> Path:
    """A module's `serve.allowed_dirs` entry: the one place admin paths may point into."""
    return tmp_path_factory.mktemp("allowed")


@pytest.fixture
def owner_check(monkeypatch):
    """The ownership check (`dvi.decode.owner`: the engine's and the drafter thread's parts) on for one test; the
    touches it saw, cleared before and after."""
    from dvi.decode import owner

    monkeypatch.setenv(owner.ENV, "1")
    owner.VIOLATIONS.clear()
    yield owner.VIOLATIONS
    owner.VIOLATIONS.clear()
