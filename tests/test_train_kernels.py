"""The trainer's own kernels, each against the plain computation it replaces: token log-probs with
their chunked backward (clawflow/policy/logprobs.py), short-row attention under CPU bf16 autocast
(clawflow/train/attention.py), fused AdamW (clawflow/train/optim.py). Real tensors, real models."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from clawflow.config import TrainConfig
from clawflow.policy.logprobs import response_logprobs, sequence_logprobs
from clawflow.train import attention, optim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 3, 32])
def test_token_logprobs_and_their_backward_match_log_softmax(dtype, chunk):
    g = torch.Generator().manual_seed(chunk)
    full = torch.randn(3, 12, 97, generator=g).to(dtype).requires_grad_()
    logits = full[:, :-1]  # the strided view the trainer passes
    targets = torch.randint(0, 97, (3, 11), generator=g)
    weights = torch.randn(3, 11, generator=g)
    got = sequence_logprobs(logits, targets, chunk_tokens=chunk)
    (got * weights).sum().backward()
    got_grad, full.grad = full.grad.clone(), None
    want = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
    (want * weights).sum().backward()
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the bf16 gradient is rounded once either way
    assert got_grad.dtype == dtype and torch.allclose(got_grad.float(), full.grad.float(), atol=tol)
    with torch.inference_mode():  # the engine and the gate score without a graph
        assert torch.allclose(sequence_logprobs(logits.detach(), targets, chunk), want.detach(), atol=1e-5)


def _qkv(b=2, h=4, kv=2, t=9, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, t, d, generator=g).requires_grad_() for n in (h, kv, kv)]


class _Module:  # what transformers passes as `module`: the attention layer's GQA ratio
    num_key_value_groups = 2
    is_causal = True


def _sdpa(q, k, v, mask):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(_Module(), q, k, v, mask, scaling=q.shape[-1] ** -0.5)[0]


def test_short_row_attention_matches_sdpa_under_bf16_autocast():
    """Causal and left-padded (a first row that attends to nothing has finite output), forward and
    backward within bf16 rounding of SDPA; without autocast, or past MAX_SCORES, it is SDPA itself."""
    q, k, v = _qkv()
    pad = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    pad[0, :, :, :3] = False  # row 0 left-padded by 3: its first 3 queries see nothing
    for mask in (None, pad):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = attention.attention(_Module(), q, k, v, mask, scaling=q.shape[-1] ** -0.5)[0]
            want = _sdpa(q, k, v, mask)
        assert got.shape == want.shape == (2, 9, 4, 8) and torch.isfinite(got).all()
        rows = slice(None) if mask is None else (slice(1, None),)  # padded queries' outputs are never used
        assert torch.allclose(got[rows].float(), want[rows].float(), atol=3e-2)
        grads = torch.autograd.grad(got[rows].float().sum(), (q, k, v))
        ref = torch.autograd.grad(want[rows].float().sum(), (q, k, v))
        for a, b in zip(grads, ref):
            assert torch.isfinite(a).all() and torch.allclose(a, b, atol=5e-2)
    plain = attention.attention(_Module(), q, k, v, None, scaling=q.shape[-1] ** -0.5)[0]
    assert torch.equal(plain, _sdpa(q, k, v, None))  # fp32: SDPA, bit for bit


def test_long_rows_keep_sdpa(monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setattr(attention, "MAX_SCORES", 2 * 4 * 9 * 9 - 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(attention.attention(_Module(), q, k, v, None, scaling=q.shape[-1] ** -0.5)[0],
                           _sdpa(q, k, v, None))


def test_a_model_set_to_it_scores_like_sdpa_and_keeps_its_config(tiny_model_dir):
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = copy.deepcopy(sdpa)
    attention.use(model)
    assert model.config._attn_implementation == attention.NAME and "clawflow" not in model.config.to_json_string()
    prompts, replies = [[5, 6, 7, 8, 9], [10, 11]], [[20, 21, 22], [30, 31, 32, 33]]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = response_logprobs(model, prompts, replies), response_logprobs(sdpa, prompts, replies)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.allclose(got[mask], want[mask], atol=5e-2)
    with torch.no_grad():  # fp32: not this path at all
        assert torch.equal(response_logprobs(model, prompts, replies), response_logprobs(sdpa, prompts, replies))


def test_adamw_is_fused_for_plain_parameters_and_takes_the_same_step():
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1)
    fused = optim.adamw(params, cfg)
    plain = torch.optim.AdamW(twins, lr=cfg.lr, weight_decay=cfg.weight_decay)
    assert fused.defaults["fused"] is True
    for step in range(3):
        for p, t in zip(params, twins):
            p.grad = t.grad = torch.randn(p.shape, generator=g)
        fused.step(), plain.step()
    for p, t in zip(params, twins):
        assert torch.allclose(p, t, atol=1e-6)
