"""End to end: a real torchrun subprocess trains a tiny random Llama on two scored turns."""

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


def train(home: Path, base: Path, batch: Path, name: str, **train) -> tuple[Path, dict, float]:
    cfg_path = write_config(home, lr=1e-2, epochs=2, micro_batch=2, **train)
    out = home / "ckpt" / name
    t0 = time.monotonic()
    metrics = run_training(cfg_path, load_config(cfg_path), base, batch, out, timeout_s=300)
    return out, metrics, time.monotonic() - t0


@pytest.fixture(scope="module")
def trained(base, batch, tmp_path_factory) -> tuple[Path, dict]:
    home = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CLAWFLOW_HOME", str(home / "home"))
        out, metrics, seconds = train(home, base, batch[0], "v1")
    print(f"run_training (nproc=1) took {seconds:.1f} s")
    return out, metrics


def test_training_moves_logprobs_the_way_of_the_reward(base, batch, trained):
    rows = batch[1]
    out, metrics = trained
    assert metrics["steps"] == 2 and len(metrics["per_step"]) == 2
    assert metrics["samples"] == 2  # the reward-0 row was skipped
    assert metrics["tokens"] == 2 * 12
    assert metrics["per_step"][0]["clip_fraction"] == 0.0  # ratio 1 against the rollout
    assert metrics["per_step"][0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    assert not out.with_name("v1.tmp").exists() and (out.parent / "v1.log").is_file()

    before = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    after = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    w0, w1 = before.state_dict(), after.state_dict()
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
    for row in rows[:2]:
        old = sum(response_logprobs(before, row["prompt_token_ids"], row["response_token_ids"]))
        new = sum(response_logprobs(after, row["prompt_token_ids"], row["response_token_ids"]))
        assert (new - old) * row["reward"] > 0, (row["reward"], old, new)


def test_two_ranks_match_one_process(base, batch, trained, home):
    """nproc=2 (one sample per rank, gradients all-reduced) takes the same steps as nproc=1."""
    out, metrics, seconds = train(home, base, batch[0], "v2", nproc=2)
    print(f"run_training (nproc=2) took {seconds:.1f} s")
    assert metrics["world_size"] == 2 and metrics["steps"] == trained[1]["steps"]
    for a, b in zip(metrics["per_step"], trained[1]["per_step"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["n_tokens"] == b["n_tokens"]
    one = AutoModelForCausalLM.from_pretrained(trained[0], dtype=torch.float32).state_dict()
    two = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 1e-4, worst


def test_missing_batch_file_raises_training_error(base, home):
    cfg_path = write_config(home)
    out = home / "ckpt" / "bad"
    with pytest.raises(TrainingError, match=r"batch file not found: .*nope\.parquet") as err:
        run_training(cfg_path, load_config(cfg_path), base, home / "nope.parquet", out, 120)
    assert err.value.returncode != 0 and not out.exists()
    assert "last lines of" in str(err.value)


def test_batch_without_trainable_samples_exits_3(base, batch, home):
    rows = [{**batch[1][0], "reward": 0.0}]
    path = home / "zero.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg_path = write_config(home)
    with pytest.raises(TrainingError, match="no trainable samples") as err:
        run_training(cfg_path, load_config(cfg_path), base, path, home / "ckpt" / "v3", 120)
    assert "exitcode  : 3" in err.value.log_path.read_text()
