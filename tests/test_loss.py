"""Loss functions and batch collation, checked against numbers worked out by hand."""

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from clawflow.train.batch import Sample, collate, load_samples
from clawflow.train.loss import binary_rl_advantages, ppo_clip_loss, sequence_logprobs

LOG = math.log


def _lp(values):
    """Logprobs whose ratio against old = 0 are exactly `values`; a leaf that takes gradients."""
    return torch.tensor([[LOG(v) for v in values]], requires_grad=True)


def test_advantages_broadcast_reward_over_response_tokens():
    mask = torch.tensor([[0.0, 1, 1, 0], [1, 1, 1, 1]])
    adv = binary_rl_advantages(torch.tensor([1.0, -1.0]), mask)
    assert adv.tolist() == [[0, 1, 1, 0], [-1, -1, -1, -1]]


def test_positive_advantage_clips_high_ratio_at_1_plus_eps_high():
    # ratios 0.5, 1.0, 1.5 with A = +1:
    #   unclipped ratio*A = 0.5, 1.0, 1.5;  clip(ratio, 0.8, 1.28)*A = 0.8, 1.0, 1.28
    #   min = 0.5, 1.0, 1.28  ->  loss tokens -0.5, -1.0, -1.28, token mean -2.78/3
    lp = _lp([0.5, 1.0, 1.5])
    old, mask = torch.zeros(1, 3), torch.ones(1, 3)
    loss, m = ppo_clip_loss(lp, old, torch.ones(1, 3), mask)
    assert loss.item() == pytest.approx(-2.78 / 3, abs=1e-6)
    loss.backward()
    # d(-ratio*A)/d logprob = -ratio*A, over 3 tokens; the clipped 1.5 token gets nothing
    assert lp.grad.tolist()[0] == pytest.approx([-0.5 / 3, -1.0 / 3, 0.0], abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(1 / 3)
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["n_tokens"] == 3


def test_negative_advantage_clips_low_ratio_at_1_minus_eps_low():
    # A = -1: unclipped = -0.5, -1.0, -1.5;  clipped = -0.8, -1.0, -1.28
    #   min = -0.8, -1.0, -1.5  ->  loss tokens 0.8, 1.0, 1.5, mean 3.3/3 = 1.1
    lp = _lp([0.5, 1.0, 1.5])
    loss, m = ppo_clip_loss(lp, torch.zeros(1, 3), -torch.ones(1, 3), torch.ones(1, 3))
    assert loss.item() == pytest.approx(1.1, abs=1e-6)
    loss.backward()
    # the 0.5 token is clipped (no gradient); the others: +ratio/3
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 1.0 / 3, 1.5 / 3], abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(1 / 3)


def test_token_mean_per_sequence_then_mean_over_sequences():
    # seq 0: 3 tokens, A=+1, ratios 0.5, 1, 1.5 -> -2.78/3 = -0.926667
    # seq 1: 1 token (2 masked), A=-1, ratio 1   -> 1.0
    # seq 2: no tokens -> left out of the mean
    # loss = (-0.926667 + 1.0) / 2 = 0.036667   (a flat token mean would give -1.78/4 = -0.445)
    lp = torch.tensor([[LOG(0.5), 0.0, LOG(1.5)], [0.0, 5.0, 5.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0], [0, 0, 0]])
    adv = binary_rl_advantages(torch.tensor([1.0, -1.0, 1.0]), mask)
    loss, m = ppo_clip_loss(lp, torch.zeros(3, 3), adv, mask)
    assert loss.item() == pytest.approx((-2.78 / 3 + 1.0) / 2, abs=1e-6)
    assert m["n_tokens"] == 4 and m["n_seqs"] == 2


def test_no_tokens_gives_zero_loss_with_a_graph():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, m = ppo_clip_loss(lp, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and lp.grad.abs().sum() == 0 and m["n_tokens"] == 0


def test_tis_weight_is_capped_and_detached():
    # ratio 1, A = +1 -> token loss -1, times w = min(exp(old - rollout), cap=2):
    #   old - rollout = log 3 -> w = min(3, 2) = 2;  log 0.5 -> w = 0.5
    #   loss = (-2 - 0.5) / 2 = -1.25
    lp = torch.zeros(1, 2, requires_grad=True)
    rollout = torch.tensor([[-LOG(3.0), -LOG(0.5)]])
    loss, _ = ppo_clip_loss(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
                            rollout_logprobs=rollout, tis_cap=2.0)
    assert loss.item() == pytest.approx(-1.25, abs=1e-6)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-2 / 2, -0.5 / 2], abs=1e-6)


@pytest.mark.parametrize("reward, direction", [(1.0, 1), (-1.0, -1)])
def test_sign_of_advantage_moves_logprob_that_way(reward, direction):
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 10, requires_grad=True)  # a "policy" that is just its logits
    targets = torch.tensor([[1, 2, 3, 4]])
    mask = torch.ones(1, 4)
    before = sequence_logprobs(logits, targets).detach()
    lp = sequence_logprobs(logits, targets)
    loss, _ = ppo_clip_loss(lp, before, binary_rl_advantages(torch.tensor([reward]), mask), mask)
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
    full = sequence_logprobs(logits, targets, chunk_tokens=3)
    (g_chunked,) = torch.autograd.grad(full.sum(), logits)
    assert torch.allclose(g_chunked, g_plain, atol=1e-6)


def _two_samples():
    return [
        Sample([5, 6, 7], [8, 9], [-0.1, -0.2], 1.0),
        Sample([3], [4, 10, 11], [-1.0, -2.0, -3.0], -1.0),
    ]


def test_collate_two_samples_by_hand():
    b = collate(_two_samples(), pad_id=0)
    # L = max(3+2, 1+3) = 5
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [3, 4, 10, 11, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert b["targets"].tolist() == [[6, 7, 8, 9], [4, 10, 11, 0]]
    # target position j predicts input token j+1: response tokens 8, 9 are targets 2, 3
    assert b["response_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    expected = torch.tensor([[0, 0, -0.1, -0.2], [-1, -2, -3, 0]])
    assert torch.allclose(b["old_logprobs"], expected)
    assert b["rewards"].tolist() == [1.0, -1.0]


def test_sample_rejects_empty_prompt_and_length_mismatch():
    with pytest.raises(ValueError, match="empty prompt"):
        Sample([], [1], [-0.5], 1.0)
    with pytest.raises(ValueError, match="2 response tokens but 1 logprobs"):
        Sample([1], [2, 3], [-0.5], 1.0)


def test_load_samples_round_trip(tmp_path):
    rows = [{"prompt_token_ids": s.prompt_token_ids, "response_token_ids": s.response_token_ids,
             "response_logprobs": s.response_logprobs, "reward": s.reward, "extra": "ignored"}
            for s in _two_samples()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet")
    loaded = load_samples(tmp_path / "b.parquet")
    assert [s.prompt_token_ids for s in loaded] == [[5, 6, 7], [3]]
    assert loaded[1].response_logprobs == [-1.0, -2.0, -3.0] and loaded[1].reward == -1.0
