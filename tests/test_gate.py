"""Eval gate on real checkpoints, at the thresholds configs/default.yaml ships (read from it):
normal → passes, NaN → rejected, degraded → rejected by the KL limit, a checkpoint that lost the
champion's answers → rejected by the NLL limit."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from clawflow.config import REPO_ROOT, HelpfulnessGateConfig, load_config
from clawflow.policy.gate import evaluate, load_pair, nonfinite_tensors

SHIPPED = load_config(REPO_ROOT / "configs" / "default.yaml").gate  # what users get


def variant(src: str, dst, fn) -> str:
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        fn(model)
    model.save_pretrained(dst)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{src}/{f}", dst / f)
    return str(dst)


@pytest.fixture(scope="module")
def gate():
    """The shipped gate section as it is (max_kl, max_nll_increase, probes, reply length), but for
    the helpfulness check: random weights answer nothing (tests/test_helpfulness.py covers it)."""
    return SHIPPED.model_copy(update={"helpfulness": HelpfulnessGateConfig(enabled=False)})


def test_the_shipped_gate_is_what_is_tested(gate):
    assert gate.enabled and (gate.max_kl, gate.max_nll_increase) == (SHIPPED.max_kl, SHIPPED.max_nll_increase)
    assert gate.probes == SHIPPED.probes and gate.max_new_tokens == SHIPPED.max_new_tokens


def test_normal_update_passes(tiny_model_dir, tmp_path, gate):
    nudged = variant(tiny_model_dir, tmp_path / "nudged",
                     lambda m: [p.add_(1e-4 * torch.randn_like(p)) for p in m.parameters()])
    result = evaluate(gate, nudged, tiny_model_dir)
    assert result.passed, result.reason
    assert 0 < result.metrics["probe_kl"] < gate.max_kl
    assert result.metrics["probe_nll_increase"] < gate.max_nll_increase
    assert result.metrics["probes"] == len(gate.probes)


def test_the_champion_side_is_computed_once_for_every_dose(tiny_model_dir, tmp_path, gate):
    """`evaluate_doses` hands one `Champion` to each dose's `evaluate`: the champion's probe replies
    are generated once, and the verdict is the one a fresh champion gives."""
    from clawflow.policy.gate import Champion

    nudged = variant(tiny_model_dir, tmp_path / "nudged",
                     lambda m: [p.add_(1e-4 * torch.randn_like(p)) for p in m.parameters()])
    fresh = evaluate(gate, nudged, tiny_model_dir)
    champion = Champion(tiny_model_dir)
    first = evaluate(gate, nudged, tiny_model_dir, champion=champion)
    replies, judged = champion.replies, champion.judged
    assert len(replies) == len(gate.probes) and judged == []
    calls = []
    generate = champion.model.generate
    champion.model.generate = lambda *a, **k: calls.append(1) or generate(*a, **k)
    second = evaluate(gate, nudged, tiny_model_dir, champion=champion)
    assert calls == [] and champion.replies is replies  # nothing generated again
    for r in (first, second):
        assert r.passed == fresh.passed and r.metrics["probe_kl"] == pytest.approx(fresh.metrics["probe_kl"])
    assert {"seconds_load", "seconds_drift", "seconds_judged"} <= set(second.metrics)


def test_the_preference_measure_is_a_contrast_with_the_champions_own_answers():
    from clawflow.policy.preference_probe import contrast

    # learned the preference: the teacher's answers likelier, its own old ones less likely
    assert contrast([-2.0, -2.0], [-1.0, -1.5], [-1.0, -1.0], [-1.2, -1.4])["pref_gain"] == pytest.approx(1.05)
    # only surer of everything it says (or a teacher that shows nothing new): both move alike, ~0
    m = contrast([-2.0, -1.0], [-1.5, -0.5], [-1.5, -1.0], [-1.0, -0.5])
    assert m == {"pref_gain": pytest.approx(0.0), "pref_gain_taught": pytest.approx(0.5),
                 "pref_gain_plain": pytest.approx(0.5)}


def test_judged_learning_needs_enough_turns_moving_toward_their_judgments():
    from clawflow.policy.gate import judged_learning

    g = SHIPPED
    assert g.require_learning and g.judged_min_turns == 3  # what ships
    moved = {"judged_pos": 2.0, "judged_neg": 2.0, "judged_pos_delta": 0.02, "judged_neg_delta": -0.05}
    assert judged_learning(moved, g)
    assert not judged_learning({**moved, "judged_pos": 1.0, "judged_neg": 1.0}, g)  # too few turns
    assert not judged_learning({**moved, "judged_pos_delta": -0.05, "judged_neg_delta": -0.05}, g)  # no direction


def test_a_run_with_nothing_to_measure_is_rejected_before_any_model_loads(tmp_path):
    """The shipped `require_learning`: no standing preference and no held-out judged turns, so
    nothing the candidate learned can be measured: rejected (the champion stays), at no cost."""
    from clawflow.policy.gate import evaluate_doses

    v = evaluate_doses(SHIPPED, str(tmp_path / "no-such-candidate"), str(tmp_path / "no-such-champion"),
                       tmp_path / "work", judged=[], taught="")
    assert not v.passed and v.dose is None and "nothing it learned can be measured" in v.reason


def test_nan_weights_are_rejected_without_probing(tiny_model_dir, tmp_path, gate):
    broken = variant(tiny_model_dir, tmp_path / "nan", lambda m: m.model.layers[0].mlp.up_proj.weight.fill_(float("nan")))
    assert nonfinite_tensors(broken) == ["model.layers.0.mlp.up_proj.weight"]
    result = evaluate(gate, broken, tiny_model_dir)
    assert not result.passed and "non-finite" in result.reason
    assert "probe_kl" not in result.metrics


def test_degraded_weights_are_rejected(tiny_model_dir, tmp_path, gate):
    # Random tiny models are near-uniform, so noise barely moves them; scaling the (tied) output
    # embedding makes every next-token distribution sharp and wrong, as a diverged run would.
    degraded = variant(tiny_model_dir, tmp_path / "degraded", lambda m: m.model.embed_tokens.weight.mul_(50))
    result = evaluate(gate, degraded, tiny_model_dir)
    assert not result.passed and f"> max_kl {gate.max_kl}" in result.reason, result.reason
    assert result.metrics["probe_kl"] > gate.max_kl


def test_a_checkpoint_that_lost_the_champions_answers_is_rejected(tiny_model_dir, tmp_path, gate):
    """Drift the KL limit cannot see: the candidate's output layer turns against exactly the tokens
    of the champion's greedy probe replies (an untied copy of the embedding with those rows negated),
    so those replies become unlikely while the rest of every distribution barely moves. The NLL
    limit rejects it."""
    tok, champ, _ = load_pair(tiny_model_dir, tiny_model_dir)
    said = set()
    for prompt in gate.probes:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        out = champ.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gate.max_new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
        said |= set(out[0, ids.shape[1]:].tolist())
    rows = torch.tensor(sorted(said))

    def forget(m):
        m.config.tie_word_embeddings = False
        head = m.model.embed_tokens.weight.detach().clone()
        head[rows] *= -1
        m.lm_head.weight = torch.nn.Parameter(head)

    forgot = variant(tiny_model_dir, tmp_path / "forgot", forget)
    result = evaluate(gate, forgot, tiny_model_dir)
    assert result.metrics["probe_kl"] < gate.max_kl  # the KL limit alone would pass it
    assert not result.passed and "probe NLL rose" in result.reason, result.reason
    assert result.metrics["probe_nll_increase"] > gate.max_nll_increase


def test_identical_checkpoint_has_zero_drift(tiny_model_dir, gate):
    result = evaluate(gate, tiny_model_dir, tiny_model_dir)
    assert result.passed
    assert result.metrics["probe_kl"] == pytest.approx(0, abs=1e-6)
    assert result.metrics["probe_nll_increase"] == pytest.approx(0, abs=1e-6)


def test_the_dose_search_walks_the_grid_then_bisects_between_too_strong_and_too_weak():
    from clawflow.policy.gate import FAILED, WEAK, next_dose

    grid = [1.0, 0.75, 0.5, 0.25]
    assert next_dose(grid, [], 1) == 1.0
    assert next_dose(grid, [(1.0, FAILED), (0.75, FAILED)], 1) == 0.5  # the grid goes on past failed checks
    assert next_dose(grid, [(1.0, WEAK)], 1) is None  # the strongest moved too little: weaker ones move less
    # terse v4: 0.5 cost facts, 0.25 moved too little: one bisection measures 0.375
    v4 = [(1.0, FAILED), (0.75, FAILED), (0.5, FAILED), (0.25, WEAK)]
    assert next_dose(grid, v4, 1) == 0.375 and next_dose(grid, v4, 0) is None
    assert next_dose(grid, [*v4, (0.375, WEAK)], 1) is None  # refinements spent
    assert next_dose(grid, [*v4, (0.375, WEAK)], 2) == 0.4375  # 0.375 too weak: toward 0.5
    assert next_dose(grid, [*v4, (0.375, FAILED)], 2) == 0.3125  # 0.375 cost facts: toward 0.25
    assert next_dose(grid, [(1.0, FAILED), (0.75, FAILED), (0.5, FAILED), (0.25, FAILED)], 2) is None  # nothing weak
    assert next_dose([1.0], [(1.0, FAILED)], 3) is None
