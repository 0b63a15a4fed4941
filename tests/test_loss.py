"""Loss and advantage functions, batch layout and run planning, checked against numbers worked out by hand."""

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from clawflow.config import TrainConfig
from clawflow.train.advantages import (binary_rl_advantages, combined_advantages, group_normalized_rewards,
                                       opd_advantages, staleness_weights)
from clawflow.train.batch import Sample, collate, load_samples
from clawflow.train.loss import AGGREGATIONS, k3_kl, ppo_clip_per_token, seq_mean, sequence_logprobs, token_mean
from clawflow.train.objective import Objective
from clawflow.train.plan import Item, plan_steps, rank_micro_batches
from clawflow.train.teacher import hinted_messages

LOG = math.log


def _lp(values):
    """Logprobs whose ratio against old = 0 are exactly `values`; a leaf that takes gradients."""
    return torch.tensor([[LOG(v) for v in values]], requires_grad=True)


def _clip_loss(logprobs, old, rewards, mask, rollout=None, tis_cap=None, dual_clip=None, aggregation="seq_mean"):
    """The RL objective as the trainer runs it (`Objective`: PPO clip, TIS when `tis_cap`, the
    aggregation) on one batch with per-sequence `rewards` [B]: (numerator / denominator, metrics)."""
    obj = Objective(rl_weight=1.0, opd_weight=0.0, eps_low=0.2, eps_high=0.28, dual_clip=dual_clip, tis_cap=tis_cap,
                    kl_beta=0.0, opd_clip=None, aggregate=AGGREGATIONS[aggregation])
    n = mask.shape[0]
    b = {"mask": mask, "old": old, "rollout": old if rollout is None else rollout, "teacher": old, "ref": old,
         "rl_adv": rewards, "has_hint": torch.zeros(n), "weight": torch.ones(n)}
    num, stats = obj(logprobs, b)
    den = obj.denominator(b)
    metrics = Objective.metrics(stats, den)
    metrics.update(n_tokens=stats["n_tok"], n_seqs=float((obj.token_mask(b).sum(-1) > 0).sum()))
    return (num / den if den else num), metrics


# -- advantages ---------------------------------------------------------------------------------------
def test_advantages_broadcast_reward_over_response_tokens():
    mask = torch.tensor([[0.0, 1, 1, 0], [1, 1, 1, 1]])
    adv = binary_rl_advantages(torch.tensor([1.0, -1.0]), mask)
    assert adv.tolist() == [[0, 1, 1, 0], [-1, -1, -1, -1]]


def test_group_normalization_by_hand():
    # group 0: rewards 1, -1, 1 -> mean 1/3, unbiased std sqrt((4/9 + 16/9 + 4/9) / 2) = sqrt(4/3) = 1.1547
    #   A = (2/3) / 1.1547 = 0.57735, (-4/3) / 1.1547 = -1.1547
    # group 1: 1, 1 -> zero variance: dropped;  -1 (no group) and 1 (alone in group 2) keep A = r
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, -1, 2])
    adv, keep = group_normalized_rewards(rewards, groups, eps=0.0)
    assert adv.tolist() == pytest.approx([0.57735, -1.1547, 0.57735, 0.0, 0.0, -1.0, 1.0], abs=1e-4)
    assert keep.tolist() == [True, True, True, False, False, True, True]


def test_opd_advantage_is_teacher_minus_old_only_on_hinted_response_tokens():
    teacher = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    old = torch.tensor([[-2.0, -1.0, -3.5], [-3.0, -3.0, -3.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    adv = opd_advantages(teacher, old, torch.tensor([True, False]), mask)
    # row 0: +1, -1, (masked); row 1 has no hint: no OPD term at all
    assert adv.tolist() == [[1.0, -1.0, 0.0], [0.0, 0.0, 0.0]]
    clipped = opd_advantages(teacher * 4, old, torch.tensor([True, True]), mask, clip=0.5)
    assert clipped.tolist() == [[-0.5, -0.5, 0.0], [-0.5, -0.5, -0.5]]  # -4+2=-2, -8+1=-7, -4+3=-1 -> -0.5


def test_combined_gives_a_no_hint_turn_only_its_rl_term():
    mask = torch.ones(2, 2)
    rl = binary_rl_advantages(torch.tensor([1.0, -1.0]), mask)
    opd = opd_advantages(torch.zeros(2, 2), torch.full((2, 2), -0.25), torch.tensor([False, True]), mask)
    adv = combined_advantages(rl, opd, rl_weight=1.0, opd_weight=2.0)
    assert adv.tolist() == [[1.0, 1.0], [-1.0 + 0.5, -1.0 + 0.5]]  # row 0: no hint, pure RL


def test_staleness_drop_and_decay():
    versions = torch.tensor([10, 9, 7, 5, 12])  # parent 10: staleness 0, 1, 3, 5, 0 (newer counts as fresh)
    assert staleness_weights(versions, 10, None).tolist() == [1, 1, 1, 1, 1]
    assert staleness_weights(versions, 10, 2, "drop").tolist() == [1, 1, 0, 0, 1]
    assert staleness_weights(versions, 10, 2, "decay", 0.5).tolist() == [1, 1, 0.5, 0.125, 1]
    with pytest.raises(ValueError, match="unknown staleness mode"):
        staleness_weights(versions, 10, 2, "forget")


# -- PPO clip ----------------------------------------------------------------------------------------
def test_positive_advantage_clips_high_ratio_at_1_plus_eps_high():
    # ratios 0.5, 1.0, 1.5 with A = +1:
    #   unclipped ratio*A = 0.5, 1.0, 1.5;  clip(ratio, 0.8, 1.28)*A = 0.8, 1.0, 1.28
    #   min = 0.5, 1.0, 1.28  ->  loss tokens -0.5, -1.0, -1.28, token mean -2.78/3
    lp = _lp([0.5, 1.0, 1.5])
    loss, m = _clip_loss(lp, torch.zeros(1, 3), torch.ones(1), torch.ones(1, 3))
    assert loss.item() == pytest.approx(-2.78 / 3, abs=1e-6)
    loss.backward()
    # d(-ratio*A)/d logprob = -ratio*A, over 3 tokens; the clipped 1.5 token gets nothing
    assert lp.grad.tolist()[0] == pytest.approx([-0.5 / 3, -1.0 / 3, 0.0], abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(1 / 3) and m["ratio_mean"] == pytest.approx(1.0)


def test_negative_advantage_clips_low_ratio_at_1_minus_eps_low():
    # A = -1: unclipped = -0.5, -1.0, -1.5;  clipped = -0.8, -1.0, -1.28
    #   min = -0.8, -1.0, -1.5  ->  loss tokens 0.8, 1.0, 1.5, mean 3.3/3 = 1.1
    lp = _lp([0.5, 1.0, 1.5])
    loss, m = _clip_loss(lp, torch.zeros(1, 3), -torch.ones(1), torch.ones(1, 3))
    assert loss.item() == pytest.approx(1.1, abs=1e-6)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 1.0 / 3, 1.5 / 3], abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(1 / 3)


def test_dual_clip_caps_the_loss_of_a_negative_advantage_token():
    # A = -1, ratio 5: PPO loss max(5, 1.28) = 5; dual clip c = 3 -> min(5, 3) = 3, no gradient.
    # ratio 2: loss 2 < 3, untouched (gradient d(ratio)/dlp = 2)
    lp = _lp([5.0, 2.0])
    pg, _, clipped = ppo_clip_per_token(lp, torch.zeros(1, 2), -torch.ones(1, 2), torch.ones(1, 2), dual_clip=3.0)
    assert pg.tolist()[0] == pytest.approx([3.0, 2.0])
    assert clipped.tolist() == [[True, False]]
    pg.sum().backward()
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 2.0])


def test_masked_tokens_contribute_nothing():
    # the masked middle token has an absurd logprob and advantage: loss and gradients ignore it
    lp = torch.tensor([[0.0, 50.0, LOG(1.5)]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    loss, m = _clip_loss(lp, torch.zeros(1, 3), torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx((-1.0 - 1.28) / 2, abs=1e-6)
    loss.backward()
    assert lp.grad[0, 1].item() == 0.0 and m["n_tokens"] == 2


def test_token_mean_per_sequence_vs_per_batch():
    # seq 0: 3 tokens, A=+1, ratios 0.5, 1, 1.5 -> token losses -0.5, -1, -1.28
    # seq 1: 1 token (2 masked), A=-1, ratio 1  -> 1.0;   seq 2: no tokens
    # seq_mean   = (-2.78/3 + 1.0) / 2 = 0.036667
    # token_mean = (-2.78 + 1.0) / 4  = -0.445
    lp = torch.tensor([[LOG(0.5), 0.0, LOG(1.5)], [0.0, 5.0, 5.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0], [0, 0, 0]])
    rewards = torch.tensor([1.0, -1.0, 1.0])
    loss, m = _clip_loss(lp, torch.zeros(3, 3), rewards, mask)
    assert loss.item() == pytest.approx((-2.78 / 3 + 1.0) / 2, abs=1e-6)
    assert m["n_tokens"] == 4 and m["n_seqs"] == 2
    loss, _ = _clip_loss(lp, torch.zeros(3, 3), rewards, mask, aggregation="token_mean")
    assert loss.item() == pytest.approx(-1.78 / 4, abs=1e-6)
    assert seq_mean(torch.ones(3, 3), mask)[1] == 2.0 and token_mean(torch.ones(3, 3), mask)[1] == 4.0


def test_no_tokens_gives_zero_loss_with_a_graph():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, m = _clip_loss(lp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and lp.grad.abs().sum() == 0 and m["n_tokens"] == 0


def test_tis_weight_is_capped_and_detached():
    # ratio 1, A = +1 -> token loss -1, times w = min(exp(old - rollout), cap=2):
    #   old - rollout = log 3 -> w = min(3, 2) = 2;  log 0.5 -> w = 0.5;   loss = (-2 - 0.5) / 2 = -1.25
    lp = torch.zeros(1, 2, requires_grad=True)
    rollout = torch.tensor([[-LOG(3.0), -LOG(0.5)]])
    loss, _ = _clip_loss(lp, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), rollout=rollout, tis_cap=2.0)
    assert loss.item() == pytest.approx(-1.25, abs=1e-6)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-2 / 2, -0.5 / 2], abs=1e-6)


def test_k3_kl_by_hand():
    # ref - lp = log 2: e^(log 2) - log 2 - 1 = 0.306853;  equal logprobs: 0;  masked: 0
    lp = torch.tensor([[-LOG(2.0), -1.0, 7.0]])
    kl = k3_kl(lp, torch.tensor([[0.0, -1.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert kl.tolist()[0] == pytest.approx([2 - LOG(2.0) - 1, 0.0, 0.0], abs=1e-6)


@pytest.mark.parametrize("reward, direction", [(1.0, 1), (-1.0, -1)])
def test_sign_of_advantage_moves_logprob_that_way(reward, direction):
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 10, requires_grad=True)  # a "policy" that is just its logits
    targets = torch.tensor([[1, 2, 3, 4]])
    mask = torch.ones(1, 4)
    before = sequence_logprobs(logits, targets).detach()
    loss, _ = _clip_loss(sequence_logprobs(logits, targets), before, torch.tensor([reward]), mask)
    loss.backward()
    with torch.no_grad():
        logits -= 0.1 * logits.grad
    after = sequence_logprobs(logits, targets).detach()
    assert (torch.sign(after - before) == direction).all()


def test_sequence_logprobs_matches_plain_log_softmax_in_chunks():
    torch.manual_seed(1)
    logits = torch.randn(3, 7, 50, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7))
    plain = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    (g_plain,) = torch.autograd.grad(plain.sum(), logits)
    chunked = sequence_logprobs(logits[:, :-1], targets[:, :-1], chunk_tokens=4)  # strided view
    assert torch.allclose(chunked, plain[:, :-1], atol=1e-6)
    (g_chunked,) = torch.autograd.grad(sequence_logprobs(logits, targets, chunk_tokens=3).sum(), logits)
    assert torch.allclose(g_chunked, g_plain, atol=1e-6)



def test_sequence_logprobs_of_k_targets_per_position_match_log_softmax_with_its_gradient():
    torch.manual_seed(2)
    logits = torch.randn(2, 5, 40, requires_grad=True)
    targets = torch.randint(0, 40, (2, 5, 3))
    targets[0, 0] = torch.tensor([7, 7, 9])  # a repeated id gets both gradients
    w = torch.rand(2, 5, 3)
    plain = torch.log_softmax(logits, -1).gather(-1, targets)
    (g_plain,) = torch.autograd.grad((plain * w).sum(), logits)
    got = sequence_logprobs(logits, targets, chunk_tokens=2)
    assert got.shape == (2, 5, 3) and torch.allclose(got, plain, atol=1e-6)
    (g_got,) = torch.autograd.grad((sequence_logprobs(logits, targets, chunk_tokens=2) * w).sum(), logits)
    assert torch.allclose(g_got, g_plain, atol=1e-6)


# -- the objective as configured ------------------------------------------------------------------------
def _objective_batch():
    # two sequences, 2 tokens each; seq 0: reward +1, no hint; seq 1: reward 0, hint (teacher - old = +0.5)
    return {"mask": torch.ones(2, 2), "old": torch.zeros(2, 2), "rollout": torch.zeros(2, 2),
            "teacher": torch.full((2, 2), 0.5), "ref": torch.zeros(2, 2), "rl_adv": torch.tensor([1.0, 0.0]),
            "has_hint": torch.tensor([False, True]), "weight": torch.ones(2)}


@pytest.mark.parametrize("objective, numerator, denominator", [
    ("rl", -1.0, 1.0),  # only seq 0 trains: token mean of -1 * ratio(1) * A(1)
    ("opd", -0.5, 1.0),  # only seq 1: -0.5
    ("combined", -1.5, 2.0),  # both; the no-hint seq 0 has no OPD term (else it would be -1 - 0.5)
])
def test_objective_chosen_from_config(objective, numerator, denominator):
    obj = Objective.from_config(TrainConfig(objective=objective, opd_weight=1.0))
    b = _objective_batch()
    lp = torch.zeros(2, 2, requires_grad=True)
    num, stats = obj(lp, b)
    assert num.item() == pytest.approx(numerator) and obj.denominator(b) == denominator
    assert obj.aggregate is seq_mean
    assert Objective.from_config(TrainConfig(aggregation="token_mean")).aggregate is token_mean


def test_objective_staleness_weight_and_kl_beta():
    obj = Objective.from_config(TrainConfig(objective="rl", kl_beta=0.5))
    b = {**_objective_batch(), "rl_adv": torch.tensor([1.0, -1.0]), "weight": torch.tensor([0.25, 0.0])}
    b["ref"] = torch.full((2, 2), LOG(2.0))  # k3 per token = 2 - log 2 - 1
    num, stats = obj(torch.zeros(2, 2, requires_grad=True), b)
    # seq 1 has weight 0: not trained; seq 0: -1 * 0.25 + 0.5 * 0.306853
    assert obj.denominator(b) == 1.0
    assert num.item() == pytest.approx(-0.25 + 0.5 * (1 - LOG(2.0)), abs=1e-6)
    assert stats["n_tok"] == 2 and stats["kl"] == pytest.approx(1 - LOG(2.0), abs=1e-6)


# -- batch and plan -------------------------------------------------------------------------------------
def test_collate_left_pads_prompts_and_right_pads_responses():
    b = collate([[5, 6, 7], [3]], [[8, 9], [4, 10, 11]], pad_id=0, rollout_logprobs=[[-0.1, -0.2], [-1, -2, -3]])
    # P = 3, R = 3, L = 6
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 3, 4, 10, 11]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert b["targets"].tolist() == [[8, 9, 0], [4, 10, 11]]
    assert b["mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert torch.allclose(b["rollout"], torch.tensor([[-0.1, -0.2, 0], [-1, -2, -3]]))
    assert b["keep"] == 4  # logits at columns 2..5; the last is dropped, 2..4 predict the 3 targets


def test_collate_logprobs_match_an_unpadded_forward():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    prompts, responses = [[1, 2, 3, 4, 5], [7, 8]], [[9, 10, 11], [12, 13, 14, 15, 16]]
    b = collate(prompts, responses, 0)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"], logits_to_keep=b["keep"]).logits[:, :-1]
        lp = sequence_logprobs(logits, b["targets"])
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids = torch.tensor([p + r])
            ref = sequence_logprobs(model(input_ids=ids).logits[:, len(p) - 1 : -1], ids[:, len(p):])[0]
            assert torch.allclose(lp[i, : len(r)], ref, atol=1e-5)


def test_sample_rejects_empty_prompt_and_length_mismatch():
    with pytest.raises(ValueError, match="empty prompt"):
        Sample([], [1], [-0.5], 1.0)
    with pytest.raises(ValueError, match="2 response tokens but 1 logprobs"):
        Sample([1], [2, 3], [-0.5], 1.0)


def test_load_samples_reads_optional_columns(tmp_path):
    rows = [{"prompt_token_ids": [5, 6], "response_token_ids": [8], "response_logprobs": [-0.1], "reward": 1.0,
             "hint": "  be brief ", "messages": '[{"role": "user", "content": "hi"}]', "group_id": "g1",
             "policy_version": 3, "extra": "ignored"},
            {"prompt_token_ids": [3], "response_token_ids": [4, 10], "response_logprobs": [-1.0, -2.0],
             "reward": -1.0, "hint": "", "messages": None, "group_id": None, "policy_version": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet")
    a, b = load_samples(tmp_path / "b.parquet")
    assert a.hint == "be brief" and a.messages == [{"role": "user", "content": "hi"}] and a.group_id == "g1"
    assert a.policy_version == 3 and b.hint is None and b.messages is None and b.policy_version == 0
    pq.write_table(pa.Table.from_pylist([{"prompt_token_ids": [1]}]), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="lacks columns"):
        load_samples(tmp_path / "bad.parquet")


def test_hint_goes_to_the_last_user_message():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "tool", "content": "d"}]
    out = hinted_messages(msgs, " be brief ")
    assert out[2]["content"] == "c\n\n[user's hint / instruction]\nbe brief" and msgs[2]["content"] == "c"
    assert out[0] == msgs[0] and out[3] == msgs[3]
    parts = hinted_messages([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "y")
    assert parts[0]["content"][-1] == {"type": "text", "text": "[user's hint / instruction]\ny"}
    assert hinted_messages([{"role": "system", "content": "s"}], "y")[-1]["role"] == "user"


def test_plan_packs_steps_by_response_tokens_and_splits_over_ranks():
    items = [Item(i, [1], [0] * n, [0.0] * n, 1.0, 1.0, None) for i, n in enumerate([3, 4, 5, 20])]
    steps = plan_steps(items, step_tokens=8, seed=0)
    assert sorted(i for s in steps for i in s) == [0, 1, 2, 3]  # each item once
    for s in steps:  # within budget, or a lone item longer than it
        assert sum(len(items[i].response) for i in s) <= 8 or len(s) == 1
    assert plan_steps(items, 8, seed=0) == steps  # same plan on every rank
    step = [10, 11, 12, 13, 14]
    assert rank_micro_batches(step, 0, 2, 2) == [[10, 12], [14]]
    assert rank_micro_batches(step, 1, 2, 2) == [[11, 13], []]  # padded: same count on every rank


def test_objective_tis_uses_the_recorded_rollout_logprobs_and_none_turns_it_off():
    b = {**_objective_batch(), "rollout": torch.full((2, 2), -LOG(3.0))}  # pi_old / pi_rollout = 3
    lp = torch.zeros(2, 2, requires_grad=True)
    capped, _ = Objective.from_config(TrainConfig(objective="rl", tis_cap=2.0))(lp, b)
    off, _ = Objective.from_config(TrainConfig(objective="rl", tis_cap=None))(lp, b)
    assert capped.item() == pytest.approx(-2.0) and off.item() == pytest.approx(-1.0)
