"""Best-of-n rewrites (`train.rewrite_samples`, `train.rewrite_select`): the hinted policy writes the
greedy rewrite and n sampled ones, each scored under the hinted and the plain prompt, and the usable
one the selection prefers is learned. Tiny random Llama with SmolLM2's tokenizer; every figure is
checked against an independent forward pass or `generate`."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawflow.contracts.sample import SCHEMA as SAMPLE_SCHEMA
from clawflow.train.rehearsal import load_rehearsal
from clawflow.train.rewrite import Candidate, choose, cut_at_eos, hint_strength, sample_candidates
from clawflow.train.teacher import teacher_prompt_ids
from tests.test_train_opd import encode, run

MAX_TOKENS = 12
MESSAGES = [{"role": "user", "content": "Tell me more."}]
HINT = "Answer in French, in one sentence."


def summed_logprob(model, prompt: list[int], reply: list[int]) -> float:
    ids = torch.tensor([prompt + reply])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    return float(lp.gather(-1, torch.tensor(reply)[:, None]).sum())


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, tok, teacher_prompt_ids(tok, MESSAGES, HINT, in_system=True), encode(tok, MESSAGES)


def test_candidates_are_the_greedy_reply_and_samples_scored_under_both_prompts(tiny):
    model, tok, hinted, plain = tiny
    eos = {tok.eos_token_id}
    other = [{"role": "user", "content": "Describe the ocean at night, please, in some detail."}]
    prompts = [(hinted, plain), (teacher_prompt_ids(tok, other, "Shorter.", in_system=True), encode(tok, other))]
    assert len(prompts[0][0]) != len(prompts[1][0])  # batched with left padding
    per_prompt = sample_candidates(model, [h for h, _ in prompts], [p for _, p in prompts], 3, MAX_TOKENS, 1.0, eos,
                                   0, seed=7)
    assert [len(c) for c in per_prompt] == [4, 4]
    for (h, p), cands in zip(prompts, per_prompt):
        x = torch.tensor([h])
        with torch.no_grad():
            greedy = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                    max_new_tokens=MAX_TOKENS, pad_token_id=0)
        assert cands[0].tokens == cut_at_eos(greedy[0, x.shape[1]:].tolist(), eos)
        assert len({tuple(c.tokens) for c in cands}) > 1  # a random model at temperature 1 does not repeat itself
        for c in cands:
            assert 0 < len(c.tokens) <= MAX_TOKENS
            assert c.hinted == pytest.approx(summed_logprob(model, h, c.tokens), abs=2e-3)
            assert c.plain == pytest.approx(summed_logprob(model, p, c.tokens), abs=2e-3)
    again = sample_candidates(model, [h for h, _ in prompts], [p for _, p in prompts], 3, MAX_TOKENS, 1.0, eos, 0,
                              seed=7)
    assert [[c.tokens for c in cs] for cs in again] == [[c.tokens for c in cs] for cs in per_prompt]  # seeded


def test_a_stopped_candidate_ends_where_it_stopped_and_the_others_come_out_as_without_it(tiny):
    """`stop` (a candidate that can no longer show what its teacher read) ends its row at the check
    after it says so, without EOS and scored on what it wrote; every other row, and the other prompt's,
    is the candidate a run without it samples."""
    from clawflow.train.rewrite import STOP_EVERY

    model, tok, hinted, plain = tiny
    other = [{"role": "user", "content": "Describe the ocean at night, please, in some detail."}]
    prompts = [(hinted, plain), (teacher_prompt_ids(tok, other, "Shorter.", in_system=True), encode(tok, other))]
    args = ([h for h, _ in prompts], [p for _, p in prompts], 3, 2 * STOP_EVERY + 4, 1.0, {tok.eos_token_id}, 0)
    free = sample_candidates(model, *args, seed=7)
    asked: list[tuple[int, int]] = []

    def stop(i: int, toks: list[int]) -> bool:  # prompt 0's candidates once they have STOP_EVERY tokens
        asked.append((i, len(toks)))
        return i == 0

    stopped = sample_candidates(model, *args, seed=7, stop=stop)
    assert {n for _, n in asked} <= {STOP_EVERY, 2 * STOP_EVERY} and {i for i, _ in asked} == {0, 1}
    for free_c, cut_c in zip(free[0], stopped[0]):
        assert cut_c.tokens == free_c.tokens[:STOP_EVERY] and len(cut_c.tokens) == STOP_EVERY
        assert cut_c.hinted == pytest.approx(summed_logprob(model, hinted, cut_c.tokens), abs=2e-3)
        assert cut_c.plain == pytest.approx(summed_logprob(model, plain, cut_c.tokens), abs=2e-3)
    assert [c.tokens for c in stopped[1]] == [c.tokens for c in free[1]]
    assert [c.plain for c in stopped[1]] == pytest.approx([c.plain for c in free[1]], abs=2e-3)


def guided_greedy_reference(model, hinted: list[int], plain: list[int], gamma: float, eos: set[int]) -> list[int]:
    """Token by token without a cache: argmax of (1 + γ) log p(·|hinted) − γ log p(·|plain)."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            lh = torch.log_softmax(model(input_ids=torch.tensor([hinted + out])).logits[0, -1].float(), -1)
            lp = torch.log_softmax(model(input_ids=torch.tensor([plain + out])).logits[0, -1].float(), -1)
            out.append(int(((1 + gamma) * lh - gamma * lp).argmax()))
            if out[-1] in eos:
                break
    return out


def test_guided_candidates_amplify_the_hint_and_are_scored_under_both_prompts(tiny):
    model, tok, hinted, plain = tiny
    eos = {tok.eos_token_id}
    other = [{"role": "user", "content": "Describe the ocean at night, please, in some detail."}]
    prompts = [(hinted, plain), (teacher_prompt_ids(tok, other, "Shorter.", in_system=True), encode(tok, other))]
    per_prompt = sample_candidates(model, [h for h, _ in prompts], [p for _, p in prompts], 2, MAX_TOKENS, 1.0, eos,
                                   0, seed=3, guidance=2.0)
    unguided = sample_candidates(model, [h for h, _ in prompts], [p for _, p in prompts], 0, MAX_TOKENS, 1.0, eos,
                                 0, seed=3)
    changed = 0
    for (h, p), cands, plain_greedy in zip(prompts, per_prompt, unguided):
        assert cands[0].tokens == cut_at_eos(guided_greedy_reference(model, h, p, 2.0, eos), eos)
        changed += cands[0].tokens != plain_greedy[0].tokens  # γ = 2 picks other tokens than the hinted policy
        for c in cands:
            assert c.hinted == pytest.approx(summed_logprob(model, h, c.tokens), abs=2e-3)
            assert c.plain == pytest.approx(summed_logprob(model, p, c.tokens), abs=2e-3)
    assert changed >= 1


@pytest.mark.parametrize("select, usable, expected", [
    ("plain", [True, True, True], 2),
    ("plain", [True, True, False], 1),  # the best is not usable
    ("poe", [True, True, True], 1),
    ("greedy", [False, True, True], 1),  # the first usable
    ("plain", [False, False, False], None),
])
def test_choose_takes_the_usable_candidate_the_selection_prefers(select, usable, expected):
    cands = [Candidate([1], hinted=-1.0, plain=-5.0), Candidate([2], hinted=-0.5, plain=-4.0),
             Candidate([3], hinted=-9.0, plain=-3.0)]
    assert choose(cands, usable, select) == expected


@pytest.mark.slow  # a training run
def test_the_run_learns_the_candidate_chosen_by_the_plain_prompt(tiny, tiny_model_dir, tmp_path):
    model, tok, hinted, plain = tiny
    row = {"turn_id": "t0", "prompt_token_ids": plain, "response_token_ids": [tok.convert_tokens_to_ids(".")] * 4,
           "response_logprobs": [-1.0] * 4, "reward": -1.0, "hint": HINT, "messages": json.dumps(MESSAGES),
           "tools": None, "group_id": None, "policy_version": 0}
    batch = tmp_path / "samples.parquet"
    pq.write_table(pa.Table.from_pylist([row], schema=SAMPLE_SCHEMA), batch)
    # the run's own seeding (seed 0, item 0) and selection, computed here independently
    (cands,) = sample_candidates(model, [hinted], [plain], 3, MAX_TOKENS, 1.0, {tok.eos_token_id}, 0, seed=0)
    best = max(cands, key=lambda c: c.plain)
    other = min(cands, key=lambda c: c.plain)
    assert other.tokens != best.tokens

    out, metrics = run(tmp_path, tiny_model_dir, batch, "bon", lr=5e-3, epochs=10, objective="distill",
                       rewrite_max_tokens=MAX_TOKENS, negative_weight=0.0, rewrite_samples=3,
                       rewrite_temperature=1.0, rewrite_select="plain")
    assert metrics["per_step"][0]["sft_tokens"] == len(best.tokens)
    log = (tmp_path / "bon.log").read_text()
    assert "best of 4 rewrites by 'plain'" in log
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    gain = {k: summed_logprob(trained, plain, c.tokens) - summed_logprob(model, plain, c.tokens)
            for k, c in (("best", best), ("other", other))}
    assert gain["best"] > 1.0 and gain["best"] > gain["other"], gain  # that candidate was learned, not another


def test_hint_strength_is_how_much_less_likely_the_hint_makes_the_plain_answers():
    # log p(plain answer | plain prompt), then | hinted prompt, per probe question
    assert hint_strength([-4.0, -6.0], [-4.2, -5.6]) == pytest.approx(-0.1)  # ignored: about 0
    assert hint_strength([-4.0, -6.0], [-9.0, -13.0]) == pytest.approx(6.0)  # followed: the answers change
    assert hint_strength([], []) == 0.0


@pytest.mark.slow  # a training run
def test_strongest_hint_rewrites_every_corrected_turn(tiny, tiny_model_dir, tmp_path):
    model, tok, _, _ = tiny
    eos = {tok.eos_token_id}
    turns = [([{"role": "user", "content": "Tell me more."}], "Answer in French, in one sentence."),
             ([{"role": "user", "content": "Can you do it?"}], "Reply with a single digit only.")]
    dots = [tok.convert_tokens_to_ids(".")] * 4
    rows = [{"turn_id": f"t{i}", "prompt_token_ids": encode(tok, m), "response_token_ids": dots,
             "response_logprobs": [-1.0] * 4, "reward": -1.0, "hint": h, "messages": json.dumps(m), "tools": None,
             "group_id": None, "policy_version": 0} for i, (m, h) in enumerate(turns)]
    batch = tmp_path / "samples.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA), batch)
    # what the run measures, computed here independently: the plain greedy answers to the first
    # rehearsal questions, log p under the plain prompt minus under the hinted one
    probes = [[{"role": "user", "content": q.prompt}] for q in load_rehearsal()[:4]]
    plain = [encode(tok, m) for m in probes]
    x = torch.tensor([plain[0]])
    with torch.no_grad():
        first = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=48,
                               pad_token_id=0)[0, x.shape[1]:].tolist()
    first = cut_at_eos(first, eos)
    strength = {}
    for _, h in turns:
        hinted = [teacher_prompt_ids(tok, m, h, in_system=True) for m in probes]
        greedy = sample_candidates(model, plain, hinted, 0, 48, 1.0, eos, 0, seed=0)
        assert greedy[0][0].tokens == first  # generated under the plain prompt
        assert greedy[0][0].plain == pytest.approx(summed_logprob(model, hinted[0], first), abs=2e-3)
        strength[h] = hint_strength([c[0].hinted for c in greedy], [c[0].plain for c in greedy])
    best = max(strength, key=strength.get)
    assert abs(strength[turns[0][1]] - strength[turns[1][1]]) > 1e-3
    rewrites = sample_candidates(model, [teacher_prompt_ids(tok, m, best, in_system=True) for m, _ in turns],
                                 [encode(tok, m) for m, _ in turns], 0, MAX_TOKENS, 1.0, eos, 0, seed=0)

    _, metrics = run(tmp_path, tiny_model_dir, batch, "strongest", lr=5e-3, epochs=1, objective="distill",
                     rewrite_max_tokens=MAX_TOKENS, negative_weight=0.0, rewrite_hints="strongest")
    log = (tmp_path / "strongest.log").read_text()
    assert f"every rewrite reads {best!r}" in log
    assert metrics["per_step"][0]["sft_tokens"] == sum(len(c[0].tokens) for c in rewrites)
