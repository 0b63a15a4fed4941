"""OPD end to end: turns judged with a hindsight hint (and score 0) train the student, without the
hint, toward the teacher that sees it. Tiny random Llama with SmolLM2's tokenizer and chat
template (the teacher prompt is built by the trainer from the recorded messages)."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawflow.config import REPO_ROOT, load_config
from clawflow.contracts.judgment import Judged
from clawflow.contracts.pair import Pair
from clawflow.contracts.sample import SCHEMA as SAMPLE_SCHEMA
from clawflow.feedback import training_samples
from clawflow.train.teacher import hinted_messages, teacher_prompt_ids

import _recipe_here as recipe_here

CONVERSATIONS = [
    ([{"role": "user", "content": "Tell me about cats."}], "Answer in French, in one sentence."),
    ([{"role": "user", "content": "What is two plus two?"}], "Reply with a single digit only."),
]
RESPONSE_TOKENS = 8


def encode(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def logits_at_response(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [R, V]


def teacher_gap(student, teacher, tok, rows) -> tuple[float, float]:
    """Over the response positions: mean KL(teacher(. | prompt + hint) || student(. | prompt)), and
    mean |log teacher(a_t) - log student(a_t)| on the sampled tokens (what OPD's advantage acts on)."""
    kls, gaps = [], []
    for row in rows:
        msgs, response = json.loads(row["messages"]), row["response_token_ids"]
        t = torch.log_softmax(logits_at_response(teacher, encode(tok, hinted_messages(msgs, row["hint"])),
                                                 response), -1)
        s = torch.log_softmax(logits_at_response(student, row["prompt_token_ids"], response), -1)
        kls.append((t.exp() * (t - s)).sum(-1).mean())
        idx = torch.tensor(response)[:, None]
        gaps.append((t.gather(-1, idx) - s.gather(-1, idx)).abs().mean())
    return float(torch.stack(kls).mean()), float(torch.stack(gaps).mean())


@pytest.fixture(scope="module")
def opd_batch(tiny_model_dir, tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i, (messages, hint) in enumerate(CONVERSATIONS):
        prompt = encode(tok, messages)
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(RESPONSE_TOKENS):
                probs = torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
                ids.append(int(torch.multinomial(probs, 1, generator=gen)))
        response = ids[len(prompt):]
        lp = torch.log_softmax(logits_at_response(model, prompt, response), -1)
        rows.append({"turn_id": f"t{i}", "prompt_token_ids": prompt, "response_token_ids": response,
                     "response_logprobs": lp.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist(),
                     "reward": 0.0, "hint": hint, "messages": json.dumps(messages), "tools": None,
                     "group_id": None, "policy_version": 0})
    path = tmp_path_factory.mktemp("opd") / "samples.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA), path)
    return path, rows


def run(tmp_path: Path, base: str, batch: Path, name: str, **train) -> tuple[Path, dict]:
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["home"] = str(tmp_path / "home")
    raw["train"].update({"micro_batch": 2, **train})
    cfg_path = tmp_path / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    out = tmp_path / name
    return out, recipe_here.train(cfg_path, load_config(cfg_path), Path(base), batch, out, frozen_base=Path(base))


def test_teacher_prompt_is_the_chat_template_of_the_hinted_messages(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages, hint = CONVERSATIONS[0]
    ids = teacher_prompt_ids(tok, messages, hint)
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert "Tell me about cats.\n\n[user's hint / instruction]\nAnswer in French, in one sentence.<|im_end|>" in text
    assert "[user's hint" not in tok.decode(encode(tok, messages)) and len(ids) > len(encode(tok, messages))


@pytest.mark.slow  # two training runs
def test_opd_moves_the_student_toward_the_hinted_teacher(tiny_model_dir, opd_batch, tmp_path):
    batch, rows = opd_batch
    # Adam moves every weight by ~lr per step whatever the advantage's size, and this random model's
    # teacher/student gap is small (~0.016 nats per token): a small lr, several steps
    out, metrics = run(tmp_path, tiny_model_dir, batch, "opd", lr=1e-5, epochs=6, objective="combined")
    first = metrics["per_step"][0]
    assert first["opd_tokens"] == 2 * RESPONSE_TOKENS and first["rl_tokens"] == 0  # score 0: OPD only
    assert first["adv_opd_mean"] != 0.0

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    (kl0, gap0), (kl1, gap1) = teacher_gap(base, base, tok, rows), teacher_gap(trained, base, tok, rows)
    print(f"KL(teacher with hint || student) {kl0:.2e} -> {kl1:.2e}; sampled-token gap {gap0:.4f} -> {gap1:.4f}")
    assert gap1 < 0.5 * gap0 and kl1 < kl0, (gap0, gap1, kl0, kl1)

    # the frozen base as teacher: here the run starts from the base, so the same first step
    _, by_base = run(tmp_path, tiny_model_dir, batch, "opd-base", lr=1e-5, epochs=1, teacher="base")
    assert by_base["per_step"][0]["loss"] == pytest.approx(first["loss"], abs=1e-6)


def test_feedback_keeps_hinted_turns_and_their_messages():
    pairs = [Pair(turn_id=f"t{i}", session_id="s", turn_index=i, prompt_token_ids=[1, 2], response_token_ids=[3],
                  response_logprobs=[-0.5], response_text="x", next_state="[]",
                  messages='[{"role": "user", "content": "hi"}]', tools=None, group_id=f"g{i}", policy_version=2)
             for i in range(3)]  # one group each: a varied group keeps its zeros too

    def judged(turn_id, score, hint):
        return Judged(turn_id=turn_id, session_id="s", judge="rules", judge_version="1", prompt_version=None,
                      score=score, votes=[score], hint=hint, reward=float(score))

    judgments = [judged("t0", 1, None), judged("t1", 0, "be brief"), judged("t2", 0, None)]
    samples = training_samples(pairs, judgments)
    assert [s.turn_id for s in samples] == ["t0", "t1"]  # the hint-only turn trains (OPD); t2 has nothing
    assert samples[1].messages == json.loads(pairs[1].messages) and samples[1].policy_version == 2
    assert samples[1].hint == "be brief" and samples[0].reward == 1.0
    assert set(samples[0].to_row()) == set(SAMPLE_SCHEMA.names)
