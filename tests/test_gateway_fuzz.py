"""Property-based fuzzing of the gateway's OpenAPI (schemathesis + hypothesis) against a live
server on the tiny model: whatever the body, no 5xx, and every 4xx carries OpenAI error JSON."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from conftest import running_gateway

DECODE_CAP = 4  # new tokens a fuzzed request may ask for: how many it decodes is not what is fuzzed


@pytest.fixture(scope="module")
def gateway_schema(tmp_path_factory, tiny_model_dir):
    import yaml

    from clawflow.config import REPO_ROOT, load_config
    from conftest import free_port

    tmp = tmp_path_factory.mktemp("fuzz")
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["home"], raw["model"] = str(tmp / "home"), {"name": "clawflow-tiny", "path": tiny_model_dir}
    raw["serving"]["port"] = free_port()
    raw["serving"]["max_new_tokens"] = DECODE_CAP  # a body without max_tokens: the same code paths, bounded
    (tmp / "config.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp / "config.yaml")
    with running_gateway(cfg):
        yield schemathesis.openapi.from_url(f"{cfg.gateway_url}/openapi.json").include(
            path_regex="^/(v1|internal/v1|admin/policy|healthz|metrics)")


def check(case) -> None:
    key = "clawflow-admin" if case.path.startswith(("/admin", "/internal")) else "clawflow"
    if isinstance(case.body, dict):  # bounded decode time, same code paths
        for name, cap in (("max_tokens", DECODE_CAP), ("max_completion_tokens", DECODE_CAP), ("n", 2)):
            if isinstance(case.body.get(name), int) and not isinstance(case.body[name], bool):
                case.body[name] = min(case.body[name], cap)
    response = case.call(headers={"Authorization": f"Bearer {key}"}, timeout=120)
    case.validate_response(response, checks=[not_a_server_error])
    if 400 <= response.status_code < 500:
        err = response.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"]


@pytest.mark.slow
def test_no_5xx_and_errors_are_openai_json(gateway_schema):
    operations = [result.ok() for result in gateway_schema.get_all_operations()]
    assert any(op.path == "/v1/chat/completions" for op in operations)
    for op in operations:
        examples = 30 if "chat" in op.path else 5

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def fuzz(case):
            check(case)

        fuzz()
