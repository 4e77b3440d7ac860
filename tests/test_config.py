"""Config errors must name the file and the key; overrides must be typed like YAML."""

from pathlib import Path

import pytest

from dvi.config import ConfigError, DviConfig, load_config

CONFIGS = sorted(Path(__file__).resolve().parent.parent.joinpath("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path) -> None:
    assert isinstance(load_config(path), DviConfig)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "text, key",
    [
        ("speculation:\n  num_draft_tokens: -1\n", "speculation.num_draft_tokens"),
        ("sampling:\n  temperature: -0.5\n", "sampling.temperature"),
        ("sampling:\n  top_p: 1.5\n", "sampling.top_p"),
        ("models:\n  target: /definitely/not/here\n", "models.target"),
        ("models:\n  preset: huge\n", "models.preset"),
        ("serve:\n  port: lots\n", "serve.port"),
        ("trainer:\n  learning_rat: 0.1\n", "trainer.learning_rat"),
        ("bogus_section: 1\n", "bogus_section"),
    ],
)
def test_errors_name_key_and_file(tmp_path: Path, text: str, key: str) -> None:
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = str(err.value)
    assert str(p) in msg
    assert key in msg


def test_unknown_key_says_unknown(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.lr: unknown key"):
        load_config(_write(tmp_path, "trainer:\n  lr: 0.1\n"))


def test_k_above_max_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_draft_tokens"):
        load_config(_write(tmp_path, "speculation:\n  num_draft_tokens: 12\n  max_draft_tokens: 8\n"))


def test_not_a_mapping_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "a: [1, 2\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_overrides_are_typed_and_validated(tmp_path: Path) -> None:
    cfg = load_config(None, ["speculation.num_draft_tokens=6", "speculation.adaptive=false",
                             "trainer.lora_targets=[q_proj, v_proj]", "serve.api_key=secret"])
    assert cfg.speculation.num_draft_tokens == 6
    assert cfg.speculation.adaptive is False
    assert cfg.trainer.lora_targets == ["q_proj", "v_proj"]
    assert cfg.serve.api_key == "secret"
    with pytest.raises(ConfigError, match=r"overrides: speculation\.num_draft_tokens=x"):
        load_config(None, ["speculation.num_draft_tokens=x"])
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        load_config(None, ["speculation.num_draft_tokens"])


def test_secrets_never_print_or_dump() -> None:
    """Issue 17 item 3: credentials are SecretStr; dumps (trainer config, wandb, manifests) leave them out."""
    import json

    from dvi.config import Secret, dump_config

    cfg = load_config(None, ["serve.api_key=k-s3cret", "serve.admin_token=t-s3cret"])
    assert isinstance(cfg.serve.api_key, Secret) and cfg.serve.api_key == "k-s3cret"
    assert cfg.serve.admin_token != "wrong" and cfg.serve.api_key != 5
    for text in (repr(cfg), str(cfg.serve.api_key), cfg.model_dump_json(), json.dumps(dump_config(cfg))):
        assert "s3cret" not in text
    assert dump_config(cfg)["serve"]["api_key"] is None and dump_config(cfg)["serve"]["admin_token"] is None
