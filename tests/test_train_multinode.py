"""Multi-node training on one machine: two torchrun agents (2 nodes x 1 process, gloo) meet at a
c10d rendezvous on a free localhost port and take the same steps as one process; a rendezvous
that cannot form fails the run with a readable reason."""

import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import free_port
from test_train import assert_same_as_one_process, base, batch, train  # noqa: F401  (fixtures: the model, the batch)

from clawflow.config import REPO_ROOT, Config, load_config
from clawflow.train.launch import TrainingError, run_training, torchrun_command


@pytest.fixture(scope="module")
def trained(base, batch, tmp_path_factory) -> tuple[Path, dict]:  # noqa: F811
    """The one-process reference, run in this process (tests/_recipe_here.py): test_train.py runs
    it under torchrun, and a second torchrun start-up here would only repeat that."""
    home = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CLAWFLOW_HOME", str(home / "home"))
        out, metrics, _ = train(home, base, batch[0], "v1", here=True)
    return out, metrics


def node_config(tmp: Path, node_rank: int, **train) -> tuple[Path, Config]:
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["train"].update({"lr": 1e-2, "epochs": 2, "micro_batch": 2, "nproc": 1, "nnodes": 2,
                         "node_rank": node_rank, **train})
    path = tmp / f"node{node_rank}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, load_config(path)


def test_command_is_standalone_only_on_one_node(tmp_path):
    one = load_config(REPO_ROOT / "configs" / "test.yaml")
    cmd = torchrun_command(tmp_path / "c.yaml", one, tmp_path, tmp_path / "b", tmp_path / "o")
    assert "--standalone" in cmd and not any(a.startswith("--rdzv") for a in cmd)
    _, two = node_config(tmp_path, 1, rdzv_endpoint="10.0.0.5:29400", rdzv_id="job-7", rdzv_timeout_s=30)
    cmd = torchrun_command(tmp_path / "c.yaml", two, tmp_path, tmp_path / "b", tmp_path / "o")
    assert "--standalone" not in cmd
    assert {"--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.5:29400",
            "--rdzv-id=job-7", "--rdzv-conf=join_timeout=30"} <= set(cmd)


@pytest.mark.parametrize("train, message", [
    ({"nnodes": 2}, "needs rdzv_endpoint"),
    ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "node_rank 2 must be below nnodes 2"),
])
def test_bad_multinode_settings_are_one_line_errors(tmp_path, train, message):
    from clawflow.config import ConfigError

    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["train"].update(train)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=message) as err:
        load_config(tmp_path / "c.yaml")
    assert "\n" not in str(err.value)


def test_two_nodes_match_one_process(base, batch, trained, tmp_path, monkeypatch):  # noqa: F811
    """Same tolerances as test_train.py's 2-rank test: loss 1e-5, grad norm 1e-4 relative,
    weights 1e-4."""
    monkeypatch.setenv("CLAWFLOW_HOME", str(tmp_path / "home"))
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", f"test-{time.time_ns()}"
    out = tmp_path / "ckpt" / "two-nodes"
    results: dict[int, object] = {}

    def node(rank: int) -> None:
        path, cfg = node_config(tmp_path, rank, rdzv_endpoint=endpoint, rdzv_id=rdzv_id, rdzv_timeout_s=120)
        try:
            results[rank] = run_training(path, cfg, base, batch[0], out, timeout_s=300, parent_version=4)
        except Exception as exc:  # noqa: BLE001 (reported below)
            results[rank] = exc

    t0 = time.monotonic()
    threads = [threading.Thread(target=node, args=(r,)) for r in (1, 0)]  # the non-host node first
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"2 nodes x 1 process took {time.monotonic() - t0:.1f} s")
    assert results[1] == {"node_rank": 1}, str(results[1])  # str: the reason, whole (repr truncates)
    metrics = results[0]
    assert isinstance(metrics, dict), str(metrics)
    assert_same_as_one_process(trained, metrics, out)
    assert (out.parent / "two-nodes.log").is_file() and (out.parent / "two-nodes.node1.log").is_file()


def test_rendezvous_that_cannot_form_fails_with_the_reason(base, batch, tmp_path, monkeypatch):  # noqa: F811
    """Node 0 of 2 waits alone: a TrainingError naming the rendezvous (Prefect's task retry then
    applies), within the join timeout, not torchrun's default 600 s."""
    monkeypatch.setenv("CLAWFLOW_HOME", str(tmp_path / "home"))
    endpoint = f"127.0.0.1:{free_port()}"
    path, cfg = node_config(tmp_path, 0, rdzv_endpoint=endpoint, rdzv_id="lonely", rdzv_timeout_s=3)
    out = tmp_path / "ckpt" / "lonely"
    t0 = time.monotonic()
    with pytest.raises(TrainingError) as err:
        run_training(path, cfg, base, batch[0], out, timeout_s=120)
    took = time.monotonic() - t0
    print(f"failed rendezvous reported in {took:.1f} s")
    assert err.value.reason.startswith("training failed (exit")
    assert f"rendezvous 'lonely' at {endpoint} did not form: 2 nodes expected within 3 s" in err.value.reason
    assert "\n" not in err.value.reason and took < 60 and not out.exists()


def test_training_task_fails_on_a_rendezvous_so_prefect_retries_it(base, batch, tmp_path, monkeypatch):  # noqa: F811
    """The flow's `train-policy` task (its body, no Prefect server): the rendezvous failure comes
    out as a TrainingError with the reason (not the "nothing to train" result), and the task
    carries a retry."""
    from tasks.training import train_policy

    monkeypatch.setenv("CLAWFLOW_HOME", str(tmp_path / "home"))
    _, cfg = node_config(tmp_path, 0, rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="task", rdzv_timeout_s=3)
    with pytest.raises(TrainingError, match="rendezvous 'task' at .* did not form"):
        train_policy.fn(cfg, "run-rdzv", str(base), batch[1])
    assert train_policy.retries >= 1
    assert not (cfg.home / "checkpoints" / "run-rdzv").exists()


def test_unreachable_rendezvous_endpoint_fails_with_the_reason(base, batch, tmp_path, monkeypatch):  # noqa: F811
    """Node 1 of 2 whose rendezvous endpoint answers nothing (node 0 never came up, a wrong host
    or port): the same one-line reason naming the endpoint, within the join timeout."""
    monkeypatch.setenv("CLAWFLOW_HOME", str(tmp_path / "home"))
    endpoint = f"127.0.0.1:{free_port()}"
    path, cfg = node_config(tmp_path, 1, rdzv_endpoint=endpoint, rdzv_id="nobody", rdzv_timeout_s=3)
    t0 = time.monotonic()
    with pytest.raises(TrainingError) as err:
        run_training(path, cfg, base, batch[0], tmp_path / "ckpt" / "nobody", timeout_s=120)
    took = time.monotonic() - t0
    print(f"unreachable rendezvous reported in {took:.1f} s: {err.value.reason}")
    assert f"rendezvous 'nobody' at {endpoint} did not form" in err.value.reason and "(node 1)" in err.value.reason
    assert "\n" not in err.value.reason and took < 90


def test_failure_reason_is_the_workers_crash_not_torchruns_banner(tmp_path):
    from clawflow.train.launch import _reason

    log = tmp_path / "node1.log"
    log.write_text("$ torchrun ...\nstep 1 loss 0.3\n"
                   "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
                   "  what():  [enforce fail at gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes\n"
                   "E1206 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: -6)\n"
                   "============================================================\n")
    assert _reason(log).startswith("what():  [enforce fail at gloo")
    log.write_text("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1\n"
                   "[rank0]: ValueError: no rows\n==========\n")
    assert _reason(log) == "[rank0]: ValueError: no rows"
    log.write_text("just a line\n==========\n")
    assert _reason(log) == "=========="
