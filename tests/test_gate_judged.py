"""The gate's held-out judged probe: recent judged turns outside the training batch, scored by the
log-likelihood of their recorded replies under champion and candidate (real DuckDB store, real
tiny models)."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from clawflow.config import GateConfig, HelpfulnessGateConfig
from clawflow.judge.store import JudgmentStore
from clawflow.policy.gate import evaluate, judged_margins, judged_verdict
from clawflow.policy.holdout import held_out_turns, in_holdout, split_holdout
from clawflow.store.catalog import Catalog
from clawflow.contracts.turn import TurnRecord
from clawflow.store.sealer import Sealer
from clawflow.store.wal import SegmentWriter

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def feedback_turns(n: int) -> list[tuple[TurnRecord, TurnRecord, int]]:
    """n sessions: a reply, then the user's verdict on it (+1 thanks / −1 correction)."""
    out = []
    for k in range(n):
        score = 1 if k % 2 == 0 else -1
        first = TurnRecord(session_id=f"s{k}", turn_index=0, policy_version=1,
                           messages=[{"role": "user", "content": f"question {k}"}],
                           prompt_token_ids=[1, 40 + k, 50 + k], response_token_ids=[100 + k, 200 + k, 300 + k, 2],
                           response_logprobs=[-1.0] * 4, response_text=f"answer {k}", finish_reason="stop",
                           new_messages=[{"role": "user", "content": f"question {k}"}], turn_id=f"turn-{k}",
                           created_at=T0 + timedelta(seconds=k))
        said = "Thanks, perfect!" if score > 0 else "No, that's wrong."
        second = TurnRecord(session_id=f"s{k}", turn_index=1, policy_version=1,
                            messages=[], prompt_token_ids=[1], response_token_ids=[7], response_logprobs=[-1.0],
                            response_text="ok", finish_reason="stop", new_messages=[{"role": "user", "content": said}],
                            turn_id=f"next-{k}", created_at=T0 + timedelta(seconds=k, milliseconds=500))
        out.append((first, second, score))
    return out


def seal_turns(home: Path, sessions) -> None:
    writer = SegmentWriter(home / "wal", fsync=False)
    for i, (first, second, _) in enumerate(sessions):
        writer.append(first)
        writer.append(second)
        if i % 4 == 3:
            writer.rotate()  # several shards
    writer.rotate()
    Sealer(writer, home / "shards", interval_s=1).seal_all()


def judge_all(home: Path, sessions) -> None:
    JudgmentStore(home).append([{"turn_id": f.turn_id, "session_id": f.session_id, "judge": "test",
                                 "judge_version": "1", "prompt_version": "1", "score": s, "votes": [s]}
                                for f, _, s in sessions])


@pytest.fixture
def judged_store(tmp_path):
    sessions = feedback_turns(12)
    seal_turns(tmp_path, sessions)
    judge_all(tmp_path, sessions)
    return Catalog(tmp_path / "catalog.duckdb", tmp_path / "shards"), sessions


def test_margins_and_verdict_by_hand():
    m = judged_margins([-2.0, -2.0, -3.0], [-2.5, -2.1, -2.0], [1, 1, -1])
    assert m == {"judged_pos": 2.0, "judged_neg": 1.0, "judged_pos_delta": pytest.approx(-0.3),
                 "judged_neg_delta": pytest.approx(1.0)}
    assert "judged good became less likely: -0.3000" in judged_verdict(m, 0.25)
    assert "judged bad became more likely: +1.0000" in judged_verdict(m, 0.5)
    assert judged_verdict(m, 1.0) is None
    assert judged_verdict(judged_margins([], [], []), 0.0) is None  # no held-out turns: nothing to say
    assert judged_verdict(m, 0.25, min_turns=3) is None  # 2 good and 1 bad turn: too few to judge by
    assert "judged good" in judged_verdict(m, 0.25, min_turns=2)


def test_a_users_line_is_gated_on_that_users_held_out_turns_alone(tmp_path):
    sessions = feedback_turns(8)
    for first, second, _ in sessions[::2]:  # sessions 0, 2, 4, 6 are bob's
        first.user = second.user = "bob"
    seal_turns(tmp_path, sessions)
    judge_all(tmp_path, sessions)
    catalog = Catalog(tmp_path / "catalog.duckdb", tmp_path / "shards")
    bobs = held_out_turns(catalog, per_sign=10, exclude=[], fraction=0.0, users=["bob"])
    assert sorted(t.turn_id for t in bobs) == ["turn-0", "turn-2", "turn-4", "turn-6"]
    assert len(held_out_turns(catalog, per_sign=10, exclude=[], fraction=0.0)) == 8  # no filter: everyone's


def test_held_out_turns_are_recent_judged_and_disjoint_from_the_batch(judged_store):
    catalog, sessions = judged_store
    batch = catalog.select_batch("run-1", max_turns=6)  # the 6 oldest pairs
    trained = [p.turn_id for p in batch]
    assert trained == [f"turn-{k}" for k in range(6)]

    held = held_out_turns(catalog, per_sign=2, exclude=trained, fraction=0.0)
    assert not {t.turn_id for t in held} & set(trained)
    assert [t.turn_id for t in held] == ["turn-11", "turn-10", "turn-9", "turn-8"]  # newest, 2 of each sign
    assert [t.score for t in held] == [-1, 1, -1, 1]
    assert held[0].response_token_ids == [111, 211, 311, 2] and held[0].prompt_token_ids == [1, 51, 61]

    # With a holdout slice, probes come only from turns the split keeps out of every batch.
    fraction = 0.5
    judgments = [SimpleNamespace(turn_id=f.turn_id) for f, _, _ in sessions]
    train, out = split_holdout(judgments, fraction)
    assert out and train and {j.turn_id for j in out} == {f.turn_id for f, _, _ in sessions
                                                               if in_holdout(f.turn_id, fraction)}
    held = held_out_turns(catalog, per_sign=10, exclude=[j.turn_id for j in train], fraction=fraction)
    assert {t.turn_id for t in held} == {j.turn_id for j in out}  # the SQL slice = the Python slice


def variant(src: str, dst: Path, fn) -> str:
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    torch.manual_seed(0)
    fn(model)
    model.save_pretrained(dst)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{src}/{f}", dst / f)
    return str(dst)


def unlearn(turns: list[dict], steps: int = 5):
    """Gradient steps that make the replies users liked less likely (a run that learned backwards)."""
    def fn(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            loss = 0.0
            for t in turns:
                ids = torch.tensor([t.prompt_token_ids + t.response_token_ids])
                n = len(t.response_token_ids)
                lp = torch.log_softmax(model(ids).logits[0, -n - 1:-1], -1)
                loss = loss + lp.gather(-1, ids[0, -n:, None]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return fn


def test_gate_rejects_a_candidate_worse_on_held_out_positives(judged_store, tiny_model_dir, tmp_path):
    catalog, _ = judged_store
    held = held_out_turns(catalog, per_sign=4, exclude=[], fraction=0.0)
    gate = GateConfig(probes=["Say hello."], max_new_tokens=4, max_kl=50.0, max_nll_increase=50.0, judged_margin=0.1,
                      helpfulness=HelpfulnessGateConfig(enabled=False))  # random weights answer nothing

    nudged = variant(tiny_model_dir, tmp_path / "nudged",
                     lambda m: [p.data.add_(1e-4 * torch.randn_like(p)) for p in m.parameters()])
    ok = evaluate(gate, nudged, tiny_model_dir, held)
    assert ok.passed, ok.reason
    assert ok.metrics["judged_pos"] == 4 and ok.metrics["judged_neg"] == 4
    assert abs(ok.metrics["judged_pos_delta"]) < 0.01 and "8 held-out judged turns" in ok.reason

    worse = variant(tiny_model_dir, tmp_path / "worse", unlearn([t for t in held if t.score > 0]))
    bad = evaluate(gate, worse, tiny_model_dir, held)
    assert not bad.passed and "judged good became less likely" in bad.reason, (bad.reason, bad.metrics)
    assert bad.metrics["judged_pos_delta"] < -0.1
