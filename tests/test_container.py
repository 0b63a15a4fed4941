"""The container image and the scale-out work pools of prefect.yaml.

The job variables are checked against the Docker and Kubernetes workers' own default base job
templates (the copy Prefect ships in `aggregate-worker-metadata.json`, which is what `prefect
work-pool create --type docker|kubernetes` starts from), and a deployment that uses them against
Prefect's own prefect.yaml model. The image is built with podman and run as a gateway. podman
comes from Debian's packages (.ci/install-podman, which `make test` runs and the test runs again):
on a Debian-like machine a podman that cannot be installed or cannot run fails that test, naming
the reason; it skips only where apt-get cannot install podman (not Debian-like, or no apt-get)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

import pytest
import yaml

from clawflow.config import REPO_ROOT
from conftest import free_port

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


def _pip_paths() -> dict[str, Path]:
    """The local wheel folder and CA bundle this machine's pip uses (`pip config list`), if any:
    the image's pip gets them too (mounted at build time), so it installs the same torch wheel and
    trusts the same TLS proxy as `make install` here."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    found: dict[str, Path] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        name, value = key.rsplit(".", 1)[-1], value.strip("'\"").split()
        if name in ("find-links", "cert") and value and Path(value[0]).exists():
            found.setdefault(name, Path(value[0]))
    return found


def _debian_mirror() -> str | None:
    """The Debian archive this machine's apt uses, for debootstrap (no registry host in our code)."""
    for f in sorted(Path("/etc/apt").glob("sources.list.d/*.sources")):
        if m := re.search(r"^URIs:\s*(\S+)", f.read_text(), re.M):
            return m.group(1)
    lst = Path("/etc/apt/sources.list")
    if lst.exists() and (m := re.search(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+\S+\s+main", lst.read_text(), re.M)):
        return m.group(1)
    return None


def _podman_env(tmp_path: Path) -> dict[str, str]:
    """podman's settings for a machine like this one: runc (crun refuses hybrid cgroups here) and
    rlimits within the host's hard limits (podman's defaults exceed them: EPERM at start)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lines = ["[containers]", f'default_ulimits = ["nofile={soft}:{hard}", "nproc=4096:4096"]']
    if shutil.which("runc"):
        lines += ["[engine]", 'runtime = "runc"']
    conf = tmp_path / "containers.conf"
    conf.write_text("\n".join(lines) + "\n")
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def _podman(env: dict[str, str], *args: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], env=env, check=True, timeout=timeout, **kw)


INSTALL_PODMAN = REPO_ROOT / ".ci" / "install-podman"
CONTAINER_TOOLS = ("podman", "runc", "debootstrap")  # what .ci/install-podman installs


def os_ids(os_release: Path = Path("/etc/os-release")) -> set[str]:
    """The distribution and those it is like (os-release's ID and ID_LIKE), e.g. {"ubuntu", "debian"}."""
    if not os_release.is_file():
        return set()
    fields = dict(line.split("=", 1) for line in os_release.read_text().splitlines() if "=" in line)
    return set(f"{fields.get('ID', '')} {fields.get('ID_LIKE', '')}".replace('"', "").replace("'", "").split())


def debian_like() -> bool:
    """A machine where .ci/install-podman can install podman: Debian or a derivative, with apt-get."""
    return "debian" in os_ids() and shutil.which("apt-get") is not None


def cannot_build(reason: str) -> None:
    """Never a silent skip where `make test` could have installed podman: on a Debian-like machine the
    test fails, saying why; elsewhere (no apt-get, not Debian) it skips."""
    if debian_like():
        pytest.fail(f"the container image was not tested on this Debian machine: {reason}")
    pytest.skip(f"not a Debian-like machine with apt-get, where .ci/install-podman works: {reason}")


def ensure_podman() -> None:
    """podman, runc and debootstrap (quick when already there), installed by .ci/install-podman as
    `make test` does; the script's own message when it cannot (not root, apt-get failed, ...)."""
    if all(shutil.which(t) for t in CONTAINER_TOOLS):
        return
    if not debian_like():
        cannot_build(f"{', '.join(t for t in CONTAINER_TOOLS if not shutil.which(t))} missing")
    done = subprocess.run([str(INSTALL_PODMAN)], capture_output=True, text=True, timeout=1200)
    missing = [t for t in CONTAINER_TOOLS if not shutil.which(t)]
    if done.returncode != 0 or missing:
        said = (done.stderr.strip() or done.stdout.strip())[-1500:] or "no output"
        cannot_build(f"podman could not be installed: .ci/install-podman exited {done.returncode}"
                     f"{f', still missing {missing}' if missing else ''}: {said}")


BASE_PACKAGES = "python3,python3-venv,python-is-python3,make,git,ca-certificates"


def base_tag(mirror: str, packages: str = BASE_PACKAGES) -> str:
    """The Debian base's tag: a digest of what debootstrap is given, so a base made from other
    packages or another archive is never taken for this one."""
    digest = hashlib.sha256(f"bookworm {mirror} {packages}".encode()).hexdigest()[:12]
    return f"localhost/clawflow-test-base:bookworm-{digest}"


def _debian_base(env: dict[str, str], tmp_path: Path) -> str:
    """A Debian bookworm base with the Python the Dockerfile needs, made with debootstrap from the
    machine's Debian archive: the default `python:3.11-slim` lives in a container registry, which
    this machine cannot reach (the Dockerfile's BASE_IMAGE argument exists for such bases). Made
    once per machine and kept (~80 s of debootstrap, like an install): its tag names its inputs."""
    mirror = _debian_mirror()
    if mirror is None:
        cannot_build("no Debian archive found in /etc/apt (sources.list.d/*.sources or sources.list) for debootstrap")
    tag = base_tag(mirror)
    if subprocess.run(["podman", "image", "exists", tag], env=env).returncode == 0:
        return tag
    rootfs = tmp_path / "rootfs"
    subprocess.run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(rootfs), mirror],
                   check=True, timeout=900, capture_output=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    _podman(env, "import", "-", tag, stdin=tar.stdout, capture_output=True)
    assert tar.wait() == 0
    shutil.rmtree(rootfs)  # 400 MB, and other tests scan the temp tree
    return tag


@pytest.mark.parametrize("release, like", [
    ('PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_ID="12"\n', True),
    ('NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\n', True),
    ('NAME="Linux Mint"\nID=linuxmint\nID_LIKE="ubuntu debian"\n', True),
    ('NAME="Fedora Linux"\nID=fedora\n', False),
    ('NAME="Rocky Linux"\nID="rocky"\nID_LIKE="rhel centos fedora"\n', False),
])
def test_debian_like_machines_are_told_apart(tmp_path, release, like):
    """Where the image test may skip (no Debian, so .ci/install-podman cannot work) and where a
    missing podman fails it: read from os-release as shipped by each distribution."""
    (tmp_path / "os-release").write_text(release)
    assert ("debian" in os_ids(tmp_path / "os-release")) is like
    assert os_ids(tmp_path / "missing") == set()


@pytest.mark.slow
def test_image_builds_and_serves_a_chat(tmp_path):
    """The image is built as documented (podman here; a Debian base, since no registry answers)
    and, run with a data volume, is a working gateway: it answers a chat completion and the turn
    lands on the volume, not in the image."""
    ensure_podman()
    env = _podman_env(tmp_path)
    info = subprocess.run(["podman", "info"], env=env, capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        cannot_build(f"podman is installed but `podman info` failed: {info.stderr.strip()[-1500:]}")
    tag, name = "localhost/clawflow-test:latest", f"clawflow-test-{os.getpid()}"
    try:
        base = _debian_base(env, tmp_path)
        build = ["build", "--network", "host", "--build-arg", f"BASE_IMAGE={base}", "-t", tag]
        pip = _pip_paths()
        if "find-links" in pip:
            build += ["-v", f"{pip['find-links']}:/opt/build-wheels:ro", "--build-arg", "PIP_FIND_LINKS=/opt/build-wheels"]
        if "cert" in pip:
            build += ["-v", f"{pip['cert']}:/etc/ssl/build-host-ca.crt:ro", "--build-arg", "PIP_CERT=/etc/ssl/build-host-ca.crt"]
        _podman(env, *build, str(REPO_ROOT), timeout=1800, capture_output=True)
        out = _podman(env, "run", "--rm", tag, "clawflow", "--help", capture_output=True, text=True).stdout
        assert "serve" in out

        data, port = tmp_path / "data", free_port()
        data.mkdir()
        _podman(env, "run", "-d", "--name", name, "--network", "host", "-v", f"{data}:/data",
                "-e", "CLAWFLOW_API_KEY=k", tag, "clawflow", "serve", "--host", "127.0.0.1", "--port", str(port),
                capture_output=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            time.sleep(2)
        else:
            logs = subprocess.run(["podman", "logs", name], env=env, capture_output=True, text=True).stderr
            pytest.fail(f"the image's gateway never answered /healthz:\n{logs[-2000:]}")
        r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer k"}, timeout=120,
                       json={"model": "x", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        _podman(env, "stop", "-t", "60", name, capture_output=True)
        recorded = [p for p in (data / "clawflow").rglob("*") if p.is_file() and p.stat().st_size
                    and {"wal", "shards"} & set(p.relative_to(data / "clawflow").parts)]
        assert recorded, sorted(str(p) for p in data.rglob("*"))[:40]
    finally:
        # The image stays (tag and layers): the next build reuses every layer above the first
        # changed input, as `docker build` does for a user; the images it replaced go
        subprocess.run(["podman", "rm", "-f", name], env=env, capture_output=True)
        subprocess.run(["podman", "image", "prune", "-f"], env=env, capture_output=True)
