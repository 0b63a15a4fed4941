"""The container image and the scale-out work pools of prefect.yaml.

The job variables are checked against the Docker and Kubernetes workers' own default base job
templates (the copy Prefect ships in `aggregate-worker-metadata.json`, which is what `prefect
work-pool create --type docker|kubernetes` starts from), and a deployment that uses them against
Prefect's own prefect.yaml model. The image is built only where a container runtime answers."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from clawflow.config import REPO_ROOT

SPEC = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()


def worker_variables(worker: str) -> dict:
    import prefect.server.api.collections_data as data

    meta = json.loads((Path(data.__path__[0]) / "views" / "aggregate-worker-metadata.json").read_text())
    for workers in meta.values():
        if worker in workers:
            return workers[worker]["default_base_job_configuration"]["variables"]
    raise LookupError(worker)


@pytest.mark.parametrize("pool, worker", [("docker_pool", "docker"), ("kubernetes_pool", "kubernetes")])
def test_pool_job_variables_fit_the_worker_template(pool, worker):
    from prefect.utilities.schema_tools.validation import validate

    job_vars = SPEC["definitions"]["work_pools"][pool]["job_variables"]
    schema = worker_variables(worker)
    assert set(job_vars) <= set(schema["properties"]), set(job_vars) - set(schema["properties"])  # no typos
    validate(job_vars, schema, raise_on_error=True, ignore_required=True)  # types and enums
    assert job_vars["env"]["CLAWFLOW_HOME"].startswith("/data") and job_vars["image"]


def test_a_deployment_on_the_docker_pool_is_a_valid_prefect_yaml():
    from prefect.cli.deploy._models import PrefectYamlModel

    defs = SPEC["definitions"]
    train = next(d for d in SPEC["deployments"] if d["name"] == "train-on-new-feedback")
    moved = {**train, "work_pool": defs["work_pools"]["docker_pool"], "pull": defs["pull_steps"]["in_image"]}
    model = PrefectYamlModel.model_validate({**SPEC, "deployments": [moved]})
    dep = model.deployments[0]
    assert dep.work_pool.job_variables["image"] == "clawflow:latest"
    assert dep.pull == [{"prefect.deployments.steps.set_working_directory": {"directory": "/opt/clawflow"}}]
    # the directory the runs start in is where the Dockerfile puts the code
    assert "WORKDIR /opt/clawflow" in DOCKERFILE


def test_dockerfile_installs_like_make():
    make_spec = re.search(r"^TORCH_SPEC \?= (\S+)$", (REPO_ROOT / "Makefile").read_text(), re.M).group(1)
    assert f"ARG TORCH_SPEC={make_spec}" in DOCKERFILE  # CPU torch by default, the Makefile's spec
    assert re.search(r"RUN make install .*TORCH_SPEC=\"\$TORCH_SPEC\"", DOCKERFILE)
    for needed in ("pyproject.toml", "constraints.txt", "clawflow", "flows", "tasks", "configs"):
        assert re.search(rf"^COPY .*\b{re.escape(needed)}\b", DOCKERFILE, re.M), needed
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".clawflow" in ignored  # never bake a laptop's venv or data in


def _runtime() -> str | None:
    for tool in ("docker", "podman"):
        if shutil.which(tool) and subprocess.run([tool, "info"], capture_output=True, timeout=30).returncode == 0:
            return tool
    return None


@pytest.mark.slow
def test_image_builds_and_runs_clawflow():
    tool = _runtime()
    if tool is None:
        pytest.skip("no container runtime answers here (`docker info` / `podman info` fail)")
    tag = "clawflow-test:latest"
    subprocess.run([tool, "build", "-t", tag, str(REPO_ROOT)], check=True, timeout=1800)
    out = subprocess.run([tool, "run", "--rm", tag, "clawflow", "--help"], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert "serve" in out
