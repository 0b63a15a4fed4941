"""Context distillation (`train.objective: distill`): a corrected turn's reply is rewritten by the
policy with the hint in its prompt, and the student learns that reply from the plain prompt.
Tiny random Llama with SmolLM2's tokenizer; the rewrite is checked token for token against an
independent greedy generation."""

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawflow.config import TrainConfig
from clawflow.policy.logprobs import response_logprobs, response_topk
from clawflow.contracts.sample import SCHEMA as SAMPLE_SCHEMA
from clawflow.train.advantages import negative_scaled
from clawflow.train.objective import Objective
from clawflow.train.plan import Item
from clawflow.train.rewrite import addresses, adds_to, cut_at_eos
from clawflow.train.rewrite_choice import usable_rewrite
from clawflow.train.teacher import teacher_prompt_ids
from tests.test_train_opd import encode, run

MAX_TOKENS = 12
# Requests made of function words only pass `addresses` whatever a random model writes; the third
# names a topic its random rewrite will not mention, so that rewrite is left out.
CONVERSATIONS = [
    ([{"role": "user", "content": "Tell me more."}], "Answer in French, in one sentence."),
    ([{"role": "user", "content": "Can you do it?"}], "Reply with a single digit only."),
    ([{"role": "user", "content": "Describe the ocean."}], "Shorter please."),
]


def nll(model, prompt: list[int], reply: list[int]) -> float:
    ids = torch.tensor([prompt + reply])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    return float(-lp.gather(-1, torch.tensor(reply)[:, None]).mean())


def test_objective_trains_rewritten_rows_by_weighted_nll_without_ratio_or_tis():
    obj = Objective.from_config(TrainConfig(objective="distill", distill_weight=0.5, tis_cap=2.0))
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.2, 0.4, 0.9]]))  # [B=2, R=3]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    b = {"mask": mask, "old": lp - 1.0, "rollout": lp - 5.0, "teacher": torch.zeros(2, 3), "ref": lp,
         "rl_adv": torch.tensor([0.0, 1.0]), "has_hint": torch.tensor([False, False]),
         "weight": torch.tensor([1.0, 1.0]), "rewrite": torch.tensor([True, False])}
    num, stats = obj(lp, b)
    # row 0: seq mean of 0.5 * NLL over its 2 tokens, whatever old/rollout say
    sft = 0.5 * -(torch.log(torch.tensor(0.5)) + torch.log(torch.tensor(0.25))) / 2
    assert stats["sft_tok"] == 2 and stats["rl_tok"] == 3
    row1, _ = Objective.from_config(TrainConfig(objective="rl", tis_cap=2.0))(lp[1:], {k: v[1:] for k, v in b.items()})
    assert float(num) == pytest.approx(float(sft) + float(row1), rel=1e-5)


def test_topk_distillation_is_cross_entropy_to_the_teachers_renormalized_topk():
    obj = Objective.from_config(TrainConfig(objective="distill", distill_topk=2, distill_weight=0.5))
    lp = torch.log(torch.tensor([[0.5, 0.25], [0.2, 0.4]]))  # [B=2, R=2] the sampled tokens
    student = torch.log(torch.tensor([[[0.5, 0.3], [0.25, 0.6]], [[0.1, 0.1], [0.1, 0.1]]]))  # [B, R, K]
    teacher = torch.log(torch.tensor([[[0.6, 0.2], [0.5, 0.5]], [[0.9, 0.1], [0.9, 0.1]]]))
    b = {"mask": torch.ones(2, 2), "old": lp, "rollout": lp, "teacher": torch.zeros(2, 2), "ref": lp,
         "rl_adv": torch.tensor([0.0, 1.0]), "has_hint": torch.tensor([False, False]), "weight": torch.ones(2),
         "rewrite": torch.tensor([True, False]), "topk_student": student, "topk_teacher": teacher}
    num, stats = obj(lp, b)
    # row 0: teacher renormalized to (0.75, 0.25) then (0.5, 0.5); seq mean of 0.5 * cross-entropy
    ce = [-(0.75 * math.log(0.5) + 0.25 * math.log(0.3)), -(0.5 * math.log(0.25) + 0.5 * math.log(0.6))]
    row1, _ = Objective.from_config(TrainConfig(objective="rl"))(lp[1:], {k: v[1:] for k, v in b.items()})
    assert float(num) == pytest.approx(0.5 * sum(ce) / 2 + float(row1), rel=1e-5)
    # without top-k the same rewritten row learns its sampled tokens
    plain, _ = Objective.from_config(TrainConfig(objective="distill", distill_weight=0.5))(lp, b)
    assert float(plain) == pytest.approx(0.5 * -(math.log(0.5) + math.log(0.25)) / 2 + float(row1), rel=1e-5)


def test_response_topk_is_the_models_likeliest_next_tokens(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts, replies = [[1, 5, 9], [4]], [[7, 8], [3, 2, 6]]
    with torch.inference_mode():
        ids, lps = response_topk(model, prompts, replies, 4)
        for b, (p, r) in enumerate(zip(prompts, replies)):
            full = torch.log_softmax(model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1], -1)
            top = full.topk(4, dim=-1)
            assert torch.equal(ids[b, : len(r)], top.indices)
            assert torch.allclose(lps[b, : len(r)], top.values, atol=1e-5)
        # the same forward scores any ids at those positions, the reply's own first
        lp, cand = response_logprobs(model, prompts, replies, candidates=ids)
    assert torch.allclose(cand, lps, atol=1e-5)
    assert torch.allclose(lp, response_logprobs(model, prompts, replies), atol=1e-6)


def test_negative_weight_scales_only_negative_advantages():
    adv = torch.tensor([1.0, -1.0, 0.0, -0.5])
    assert negative_scaled(adv, 0.25).tolist() == [1.0, -0.25, 0.0, -0.125]
    assert negative_scaled(adv, 1.0) is adv


def test_cut_at_eos_keeps_the_eos_token():
    assert cut_at_eos([5, 6, 2, 0, 0], {2}) == [5, 6, 2]
    assert cut_at_eos([5, 6], {2}) == [5, 6]


@pytest.mark.slow  # a training run
def test_distill_rewrites_corrected_replies_and_the_student_learns_them(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rows, expected = [], []
    for i, (messages, hint) in enumerate(CONVERSATIONS):
        prompt = encode(tok, messages)
        # what the user corrected; never trained on
        recorded = [tok.convert_tokens_to_ids(".")] * 4
        rows.append({"turn_id": f"t{i}", "prompt_token_ids": prompt, "response_token_ids": recorded,
                     "response_logprobs": [-1.0] * 4, "reward": -1.0, "hint": hint, "messages": json.dumps(messages),
                     "tools": None, "group_id": None, "policy_version": 0})
        hinted = torch.tensor([teacher_prompt_ids(tok, messages, hint, in_system=True)])
        with torch.no_grad():
            gen = base.generate(hinted, attention_mask=torch.ones_like(hinted), do_sample=False,
                                max_new_tokens=MAX_TOKENS, pad_token_id=0)
        reply = cut_at_eos(gen[0, hinted.shape[1]:].tolist(), {tok.eos_token_id})
        if addresses(messages[-1]["content"], tok.decode(reply, skip_special_tokens=True)):
            expected.append((prompt, reply))
    assert len(expected) == 2
    # a good turn whose "hint" is the user moving on: reinforced as recorded, never rewritten
    good = [tok.convert_tokens_to_ids("Sure")] * 3
    rows.append({**rows[0], "turn_id": "t-good", "response_token_ids": good, "response_logprobs": [-1.0] * 3,
                 "reward": 1.0, "hint": "Thanks! Next: what is the capital of Peru?"})
    batch = tmp_path / "samples.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA), batch)

    out, metrics = run(tmp_path, tiny_model_dir, batch, "distill", lr=5e-3, epochs=10, objective="distill",
                       rewrite_max_tokens=MAX_TOKENS, negative_weight=0.0)
    steps = metrics["per_step"]
    assert steps[0]["rl_tokens"] == 3  # only the good turn's recorded reply; corrected ones are replaced
    # exactly the greedy hinted replies that still answer their request
    assert steps[0]["sft_tokens"] == sum(len(r) for _, r in expected)
    assert steps[-1]["sft_nll"] < steps[0]["sft_nll"]
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    before = sum(nll(base, p, r) for p, r in expected) / len(expected)
    after = sum(nll(trained, p, r) for p, r in expected) / len(expected)
    print(f"NLL of the hinted replies from the plain prompt: {before:.3f} -> {after:.3f}")
    assert after < 0.7 * before


@pytest.mark.parametrize("request_, reply, ok", [
    ("Summarize why people like gardening.", "People garden to relax and grow food.", True),
    ("Summarize why people like gardening.", "I'm sorry for any confusion.", False),
    ("Why is the sky blue?", "The answer to this question is:", False),
    ("How do I keep houseplants alive?", "Water your houseplant weekly.", True),  # plural stemmed
    ("What is it?", "Anything at all.", True),  # nothing to match on: not judged
    ("Explain compound interest simply.", "Sorry, compound interest is interest on interest.", False),
])
def test_a_rewrite_must_still_answer_the_request(request_, reply, ok):
    assert addresses(request_, reply) is ok


@pytest.mark.parametrize("request_, reply, ok", [
    ("What is the main ingredient in ketchup?", "The main ingredient in ketchup is ketchup.", False),
    ("What gas do humans need to breathe to live?", "Humans need to breathe to live.", False),
    ("What do we call animals that eat only plants?", "Animals that eat only plants are called animals.", False),
    ("What is 7 times 8?", "7 times 8 is 7 times 8.", False),
    ("What is 7 times 8?", "7 times 8 is 56.", True),  # a number of its own
    ("What is the chemical symbol for gold?", "It is Au.", True),  # two letters count
    ("What is the capital of France?", "Paris.", True),
    ("Can you do it?", "\n\n", True),  # nothing of its own to restate: not judged, as in `addresses`
])
def test_a_rewrite_must_say_something_its_request_did_not(request_, reply, ok):
    assert adds_to(request_, reply) is ok


def test_a_rewrite_that_loops_or_restates_the_request_is_not_learned():
    it = Item(index=0, prompt=[1], response=[2], rollout=[0.0], rl_adv=0.0, weight=1.0, teacher_prompt=[1],
              rewrite=True, request="Which words rhyme with light?")
    eos = {0}
    assert usable_rewrite(it, [5, 6], "Bright, night and kite rhyme with light.", eos)
    assert not usable_rewrite(it, [5, 6], "The words that rhyme with light are: " + "light, " * 12, eos)
    assert not usable_rewrite(it, [5, 6], "Words rhyme with light.", eos)
    assert not usable_rewrite(it, [0], "", eos)
