"""Teacher, replay and hint-generator config: validation with one-line errors, documented fields,
and no way for an API key to be echoed back from a config error."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from meshrl.config.base import ConfigError, describe_fields, load_config
from meshrl.config.replay import TeacherPanelConfig
from meshrl.config.sdpo import HintGeneratorConfig
from meshrl.config.teachers import TeacherEndpointConfig

PASTED_KEY = "sk-proj-abc123-PASTED-INTO-THE-WRONG-FIELD"


def teacher(name: str = "t1", **overrides) -> dict:
    return {"name": name, "base_url": "https://api.example.com/v1/", "model": "m", **overrides}


def test_valid_endpoint_normalises_url():
    cfg = TeacherEndpointConfig(**teacher(api_key_env="OPENAI_API_KEY"))
    assert cfg.base_url == "https://api.example.com/v1"
    assert cfg.api_key_env == "OPENAI_API_KEY"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"base_url": "api.example.com/v1"}, "http(s) URL"),
        ({"base_url": "ftp://api.example.com"}, "http(s) URL"),
        ({"base_url": "https://user:pw@api.example.com/v1"}, "without credentials"),
        ({"timeout_s": 0}, "greater than 0"),
        ({"max_concurrency": 0}, "greater than or equal to 1"),
        ({"backoff_base_s": 2.0, "backoff_max_s": 1.0}, "backoff_max_s must be >= backoff_base_s"),
        ({"api_key_env": "MY KEY"}, "name of an environment variable"),
    ],
)
def test_invalid_endpoint_fields(overrides, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TeacherEndpointConfig(**teacher(**overrides))


def test_key_pasted_into_api_key_env_is_rejected_without_echoing_it(tmp_path):
    path = tmp_path / "replay.yaml"
    path.write_text(f"teachers:\n  - name: t1\n    base_url: https://x.example/v1\n    model: m\n    api_key_env: {PASTED_KEY}\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(TeacherPanelConfig, path)
    message = str(excinfo.value)
    assert "teachers.0.api_key_env" in message and "redacted" in message
    assert PASTED_KEY not in message and "sk-proj" not in message


def test_replay_config_checks_k_against_teacher_count_and_unique_names():
    three = [teacher("a"), teacher("b"), teacher("c")]
    assert TeacherPanelConfig(teachers=three, agreement_k=3).agreement_k == 3
    with pytest.raises(ValidationError, match="agreement_k = 4 exceeds the 3 teachers"):
        TeacherPanelConfig(teachers=three, agreement_k=4)
    with pytest.raises(ValidationError, match="unique"):
        TeacherPanelConfig(teachers=[teacher("a"), teacher("a")])
    with pytest.raises(ValidationError):
        TeacherPanelConfig(teachers=three, agreement_k=0)
    with pytest.raises(ValidationError):
        TeacherPanelConfig(canonicaliser="regex")


def test_enabled_hint_generator_needs_an_endpoint():
    assert not HintGeneratorConfig().enabled
    with pytest.raises(ValidationError, match="needs an endpoint"):
        HintGeneratorConfig(enabled=True)
    assert HintGeneratorConfig(enabled=True, endpoint=teacher()).endpoint.name == "t1"


def test_key_under_an_unknown_field_is_not_echoed(tmp_path):
    path = tmp_path / "replay.yaml"
    path.write_text(f"teachers:\n  - name: t1\n    base_url: https://x.example/v1\n    model: m\n    api_key: {PASTED_KEY}\n")
    with pytest.raises(ConfigError) as excinfo:
        load_config(TeacherPanelConfig, path)
    assert str(excinfo.value) == f"{path}: unknown key 'teachers.0.api_key'"


@pytest.mark.parametrize("cls", [TeacherEndpointConfig, TeacherPanelConfig, HintGeneratorConfig])
def test_every_field_is_documented(cls):
    undocumented = [name for name, field in cls.model_fields.items() if not (field.description or "").strip()]
    assert undocumented == []
    assert all(description for _, _, description in describe_fields(cls))
