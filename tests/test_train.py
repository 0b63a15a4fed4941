"""End to end: a real torchrun subprocess trains a tiny random Llama on two scored turns:
it learns, N ranks under FSDP2 take the same steps as one process, an interrupted run resumes."""

import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from clawflow.config import REPO_ROOT, load_config
from clawflow.train.launch import TrainingError, run_training
from clawflow.train.loss import sequence_logprobs

import _recipe_here as recipe_here

PROMPTS = [[1, 17, 42, 99, 7], [1, 200, 3, 64]]
REWARDS = [1.0, -1.0]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("base")
    LlamaForCausalLM(config).save_pretrained(path)
    (path / "tokenizer_config.json").write_text("{}")  # stands in for the tokenizer files
    return path


def response_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
        lp = sequence_logprobs(logits, ids[:, 1:])[0]
    return lp[len(prompt) - 1 :].tolist()


def sample_response(model, prompt: list[int], n: int, gen: torch.Generator) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            probs = torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
            ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def batch(base, tmp_path_factory) -> tuple[Path, list[dict]]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for prompt, reward in zip(PROMPTS, REWARDS):
        response = sample_response(model, prompt, 6, gen)
        rows.append({"prompt_token_ids": prompt, "response_token_ids": response,
                     "response_logprobs": response_logprobs(model, prompt, response),
                     "reward": reward})
    rows.append({**rows[0], "reward": 0.0})  # reward 0: skipped
    path = tmp_path_factory.mktemp("batch") / "samples.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path, rows


def write_config(tmp_path: Path, **train) -> Path:
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["train"].update(train)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CLAWFLOW_HOME", str(tmp_path / "home"))
    return tmp_path


def train(home: Path, base: Path, batch: Path, name: str, stop_after: int = 0, here: bool = False,
          **train) -> tuple[Path, dict, float]:
    """Under torchrun, as users run it; `here`: the same recipe in this process (tests/_recipe_here.py)."""
    cfg_path = write_config(home, lr=1e-2, epochs=2, micro_batch=2, **train)
    out = home / "ckpt" / name
    t0 = time.monotonic()
    if here:
        metrics = recipe_here.train(cfg_path, load_config(cfg_path), base, batch, out, parent_version=4)
    else:
        metrics = run_training(cfg_path, load_config(cfg_path), base, batch, out, timeout_s=300, parent_version=4,
                               stop_after=stop_after)
    return out, metrics, time.monotonic() - t0


def weights(path: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.fixture(scope="module")
def trained(base, batch, tmp_path_factory) -> tuple[Path, dict]:
    home = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CLAWFLOW_HOME", str(home / "home"))
        out, metrics, seconds = train(home, base, batch[0], "v1")
    print(f"run_training (nproc=1) took {seconds:.1f} s")
    return out, metrics


def assert_same_as_one_process(trained, metrics: dict, out: Path) -> None:
    """A 2-rank run (one node or two) took the same steps, losses and weights as 1 process."""
    assert metrics["world_size"] == 2 and metrics["steps"] == trained[1]["steps"]
    for a, b in zip(metrics["per_step"], trained[1]["per_step"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["n_tokens"] == b["n_tokens"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    one, two = weights(trained[0]), weights(out)
    assert one.keys() == two.keys()
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 1e-4, worst


def test_training_moves_logprobs_the_way_of_the_reward(base, batch, trained):
    rows = batch[1]
    out, metrics = trained
    assert metrics["steps"] == 2 and len(metrics["per_step"]) == 2
    assert metrics["samples"] == 3 and metrics["trainable"] == 2  # the reward-0 row has no term
    assert metrics["tokens"] == 2 * 12
    first, second = metrics["per_step"]
    assert first["clip_fraction"] == 0.0 and first["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # pi_old = pi
    assert first["adv_rl_mean"] == 0.0 and first["opd_tokens"] == 0  # +1 and -1 over 6 tokens each
    assert second["ratio_mean"] != pytest.approx(1.0, abs=1e-4)  # the step moved the policy
    for key in ("grad_norm", "tokens_per_s", "mfu", "peak_mem_mb", "kl", "lr"):
        assert first[key] >= 0 and key in second, key
    # −A·ratio over a +1 and a −1 reply of equal length: zero up to float rounding, either sign
    assert abs(first["pg_loss"]) < 1e-5 and "pg_loss" in second
    files = {f.name for f in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json",
            "clawflow_meta.json", "train_metrics.json", "trainer_state"} <= files
    meta = json.loads((out / "clawflow_meta.json").read_text())
    assert meta["parent_version"] == 4 and meta["loss"]["last"] == second["loss"] and meta["objective"] == "combined"
    assert (out / "trainer_state" / "optimizer.pt").is_file()
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:  # the tied head is stored once, in the model's dtype
        assert "lm_head.weight" not in f.keys() and f.get_tensor("model.norm.weight").dtype == torch.float32
    assert not out.with_name("v1.tmp").exists() and not out.with_name("v1.resume").exists()
    assert (out.parent / "v1.log").is_file()

    before = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    after = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    w0, w1 = before.state_dict(), after.state_dict()
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
    for row in rows[:2]:
        old = sum(response_logprobs(before, row["prompt_token_ids"], row["response_token_ids"]))
        new = sum(response_logprobs(after, row["prompt_token_ids"], row["response_token_ids"]))
        assert (new - old) * row["reward"] > 0, (row["reward"], old, new)


def test_bf16_autocast_run_takes_the_fp32_steps_within_rounding(base, batch, trained, home):
    out, metrics, _ = train(home, base, batch[0], "bf16", here=True, autocast="bfloat16")
    assert metrics["bf16_autocast"] == 1.0 and trained[1]["bf16_autocast"] == 0.0
    assert metrics["steps"] == trained[1]["steps"]
    for a, b in zip(metrics["per_step"], trained[1]["per_step"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=0.05) and a["loss"] != b["loss"]  # bf16 matmuls ran
    first = metrics["per_step"][0]
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # pi_old is the bf16 forward itself
    assert metrics["per_step"][1]["ratio_mean"] == pytest.approx(trained[1]["per_step"][1]["ratio_mean"], abs=0.02)
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.float32
    assert "clawflow.train: bf16 autocast" in (out.parent / "bf16.log").read_text()
    # the run attended with train/attention.py's short-row path; the checkpoint does not name it
    assert "clawflow_cpu_bf16" not in (out / "config.json").read_text()
    assert json.loads((out / "train_metrics.json").read_text())["bf16_autocast"] == 1.0


def test_two_ranks_match_one_process(base, batch, trained, home):
    """torchrun --nproc_per_node=2: FSDP2 (fully_shard per layer, then the root, gloo), one sample
    per rank, takes the same steps as one process on the whole batch. Activation checkpointing on
    (it recomputes, it must not change the math)."""
    out, metrics, seconds = train(home, base, batch[0], "v2", nproc=2, activation_checkpointing=True)
    print(f"run_training (nproc=2) took {seconds:.1f} s")
    assert_same_as_one_process(trained, metrics, out)


def test_interrupted_run_resumes_to_the_same_weights(base, batch, trained, home):
    with pytest.raises(TrainingError, match="exit") as err:
        train(home, base, batch[0], "r", stop_after=1)
    out = home / "ckpt" / "r"
    assert err.value.resumable and not out.exists()
    assert (out.with_name("r.resume") / "optimizer.pt").is_file()
    out, metrics, _ = train(home, base, batch[0], "r")  # the same call again resumes at step 2
    assert [r["step"] for r in metrics["per_step"]] == [1, 2]
    assert "resuming at step 2" in (out.parent / "r.log").read_text()
    assert metrics["per_step"][1]["loss"] == pytest.approx(trained[1]["per_step"][1]["loss"], abs=1e-6)
    one, resumed = weights(trained[0]), weights(out)
    worst = max((one[k] - resumed[k]).abs().max().item() for k in one)
    assert worst < 1e-6, worst
    assert not out.with_name("r.resume").exists()


def test_missing_batch_file_raises_training_error(base, home):
    cfg_path = write_config(home)
    out = home / "ckpt" / "bad"
    with pytest.raises(TrainingError, match=r"batch file not found: .*nope\.parquet") as err:
        run_training(cfg_path, load_config(cfg_path), base, home / "nope.parquet", out, 120)
    assert err.value.returncode != 0 and not out.exists()
    assert "last lines of" in str(err.value)


def test_batch_without_trainable_samples_exits_3(base, batch, home, capsys):
    """Input errors are caught before the process group starts: checked in-process (no torchrun)."""
    from clawflow.train.recipe import main

    rows = [{**batch[1][0], "reward": 0.0, "hint": None}]
    path = home / "zero.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg_path = write_config(home)
    code = main(["--config", str(cfg_path), "--base", str(base), "--batch", str(path), "--out", str(home / "v3")])
    err = capsys.readouterr().err
    assert code == 3 and "no trainable samples" in err and not (home / "v3").exists()
    assert err.count("\n") == 1  # one line, no traceback
