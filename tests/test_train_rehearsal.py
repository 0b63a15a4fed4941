"""Rehearsal (train.rehearsal) and the rewrite filters of `distill`: which hinted rewrites are learned."""

import glob
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawflow.config import REPO_ROOT
from clawflow.contracts.sample import SCHEMA as SAMPLE_SCHEMA
from clawflow.helpfulness import load_questions
from clawflow.train.checkpoint import META_FILE
from clawflow.train.rehearsal import DEFAULT_FILE, load_rehearsal, pair_with_hints
from clawflow.train.rewrite import cut_at_eos
from clawflow.train.teacher import chat_prompt_ids, system_hinted_messages, teacher_prompt_ids
from tests.test_train_distill import CONVERSATIONS, MAX_TOKENS
from tests.test_train_opd import encode, run


def test_rehearsal_questions_are_never_the_gates_or_the_benchmarks():
    rehearsal = {q.prompt.lower() for q in load_rehearsal()}
    assert len(rehearsal) >= 30
    held_out = {q.prompt.lower() for q in load_questions()}
    assert not rehearsal & held_out
    bench_text = " ".join(open(f).read().lower() for f in glob.glob(str(REPO_ROOT / "configs" / "envs" / "*.yaml")))
    assert not [p for p in rehearsal if p in bench_text]


def test_a_malformed_rehearsal_file_names_the_file_and_line(tmp_path):
    bad = tmp_path / "rehearsal.yaml"
    bad.write_text("questions:\n  - {prompt: 'What is it?', facts: ['x']}\n  - {prompt: 'No facts?'}\n")
    with pytest.raises(ValueError, match=rf"^{bad}:3: missing `facts`"):
        load_rehearsal(bad)
    assert DEFAULT_FILE.is_file()


def test_pairing_uses_each_distinct_hint_in_turn_and_nothing_without_a_hint():
    qs = load_rehearsal()
    assert pair_with_hints(qs, [], 8, 0) == [] and pair_with_hints(qs, ["  "], 8, 0) == []
    pairs = pair_with_hints(qs, ["Shorter.", "Use a list.", "Shorter."], 5, 3)
    assert [h for _, h in pairs] == ["Shorter.", "Use a list.", "Shorter.", "Use a list.", "Shorter."]
    assert len({q.prompt for q, _ in pairs}) == 5
    assert pairs == pair_with_hints(qs, ["Use a list.", "Shorter."], 5, 3)  # seeded, order-free
    assert [q for q, _ in pairs] != [q for q, _ in pair_with_hints(qs, ["Shorter."], 5, 4)]  # another run
    assert len(pair_with_hints(qs, ["Shorter."], 1000, 0)) == len(qs)


def test_the_rewrite_hint_goes_into_the_system_message():
    msgs = [{"role": "user", "content": "Hi?"}]
    assert system_hinted_messages(msgs, " Be brief. ") == [{"role": "system", "content": "Be brief."}, *msgs]
    with_sys = [{"role": "system", "content": "You are Claw."}, *msgs]
    hinted = system_hinted_messages(with_sys, "Be brief.")
    assert hinted[0] == {"role": "system", "content": "You are Claw.\n\nBe brief."} and hinted[1:] == msgs
    assert with_sys[0]["content"] == "You are Claw."  # a copy


@pytest.mark.slow  # a training run
def test_rehearsal_answers_that_state_their_fact_are_learned_and_the_others_left_out(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def greedy(ids: list[int]) -> list[int]:
        x = torch.tensor([ids])
        with torch.no_grad():
            gen = base.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_TOKENS,
                                pad_token_id=0)
        return cut_at_eos(gen[0, x.shape[1]:].tolist(), {tok.eos_token_id})

    # requests of function words only, so the random model's answers are never judged off the request;
    # ".*" is stated by any answer, "zzzqx" by none
    qfile = tmp_path / "questions.yaml"
    qfile.write_text(yaml.safe_dump({"questions": [{"prompt": "What is it?", "facts": [".*"]},
                                                   {"prompt": "Can you do that?", "facts": ["zzzqx"]}]}))
    messages, hint = CONVERSATIONS[0]
    row = {"turn_id": "t0", "prompt_token_ids": encode(tok, messages), "response_logprobs": [-1.0] * 4,
           "response_token_ids": [tok.convert_tokens_to_ids(".")] * 4, "reward": -1.0, "hint": hint,
           "messages": json.dumps(messages), "tools": None, "group_id": None, "policy_version": 0}
    batch = tmp_path / "samples.parquet"
    pq.write_table(pa.Table.from_pylist([row], schema=SAMPLE_SCHEMA), batch)
    corrected = greedy(teacher_prompt_ids(tok, messages, hint, in_system=True))
    rehearsed = greedy(teacher_prompt_ids(tok, [{"role": "user", "content": "What is it?"}], hint, in_system=True))

    out, metrics = run(tmp_path, tiny_model_dir, batch, "rehearsal", lr=5e-3, epochs=10, objective="distill",
                       rewrite_max_tokens=MAX_TOKENS, negative_weight=0.0, rehearsal=2,
                       rehearsal_prompts=str(qfile))
    assert json.loads((out / META_FILE).read_text())["counts"]["rehearsal"] == 2
    assert metrics["per_step"][0]["sft_tokens"] == len(corrected) + len(rehearsed)
    log = (tmp_path / "rehearsal.log").read_text()
    assert "1 of 3 rewrites left out" in log
    # learned from the plain prompt
    plain = chat_prompt_ids(tok, [{"role": "user", "content": "What is it?"}])
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()

    def nll(model) -> float:
        ids = torch.tensor([plain + rehearsed])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, len(plain) - 1 : -1], -1)
        return -logp.gather(-1, torch.tensor(rehearsed)[:, None]).mean().item()

    assert nll(trained) < 0.7 * nll(base)
