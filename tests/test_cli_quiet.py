"""What the `dvi` command shows a user (issue 59 §7): transformers' deprecation FutureWarnings and per-load
progress bars are silenced at the CLI's entry, nothing else is; and `dvi dashboard` writes the shipped dashboard."""

from __future__ import annotations

import warnings

import pytest

from dvi import cli


@pytest.fixture
def quiet(monkeypatch):
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr("sys.warnoptions", [])
    was = hf_logging.is_progress_bar_enabled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli._quiet_for_users()
        yield caught
    if was:
        hf_logging.enable_progress_bar()


def test_transformers_deprecations_are_silenced_and_nothing_else(quiet) -> None:
    from transformers.utils import logging as hf_logging

    warnings.warn("`past_key_values` is deprecated and will be removed in version 5.40.0 for "
                  "`LlamaForCausalLM.forward`. Use `cache` instead.", FutureWarning, stacklevel=1)
    warnings.warn("`foo` is deprecated and removed starting from version 5.0.", FutureWarning, stacklevel=1)
    warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
                  "`is_activation_checkpointing` instead.", FutureWarning, stacklevel=1)  # transformers 5.x's form
    warnings.warn("a FutureWarning of another kind", FutureWarning, stacklevel=1)
    warnings.warn("`x` is deprecated and will be removed in version 2", UserWarning, stacklevel=1)
    assert [str(w.message) for w in quiet] == ["a FutureWarning of another kind",
                                               "`x` is deprecated and will be removed in version 2"]
    assert not hf_logging.is_progress_bar_enabled()


def test_warning_options_keep_every_warning(monkeypatch) -> None:
    monkeypatch.setattr("sys.warnoptions", ["default"])
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli._quiet_for_users()
        warnings.warn("`a` is deprecated and will be removed in version 9.", FutureWarning, stacklevel=1)
    assert len(caught) == 1


def test_dvi_dashboard_writes_the_shipped_dashboard(tmp_path, capsys, monkeypatch) -> None:
    from dvi.metrics.dashboard import DASHBOARD_PATH

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # main() leaves this process's progress bars alone

    out = tmp_path / "dvi.json"
    assert cli.main(["dashboard", "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == DASHBOARD_PATH.read_text(encoding="utf-8")
    capsys.readouterr()
    assert cli.main(["dashboard"]) == 0
    assert capsys.readouterr().out == DASHBOARD_PATH.read_text(encoding="utf-8")
