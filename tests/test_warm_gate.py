"""The base's side of the first round's gate, measured when the gateway starts (clawflow/policy/warm.py):
the gate then finds it in its cache and measures only the candidate."""

from __future__ import annotations

import time

import torch
import yaml

from clawflow.config import REPO_ROOT, load_config
from clawflow.helpfulness import load_questions
from clawflow.policy import warm
from clawflow.policy.gate import evaluate_doses

SHIPPED = load_config(REPO_ROOT / "configs" / "default.yaml").gate


def small_gate_files(tmp_path) -> dict:
    """8 of the shipped preference prompts and 12 of the helpfulness questions: the test's time."""
    prompts = yaml.safe_load((REPO_ROOT / "configs" / "eval" / "preference_prompts.yaml").read_text())["prompts"][:8]
    (tmp_path / "prompts.yaml").write_text(yaml.safe_dump({"prompts": prompts}))
    questions = [{"prompt": q.prompt, "facts": q.facts} for q in load_questions()[:12]]
    (tmp_path / "questions.yaml").write_text(yaml.safe_dump({"questions": questions}))
    return {"preference_prompts": str(tmp_path / "prompts.yaml"), "warm_on_start": True,
            "helpfulness": {"enabled": True, "questions": str(tmp_path / "questions.yaml")}}


def stamps(cache) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in cache.glob("*.json")}


def test_the_shipped_gateway_warms_the_gate():
    assert SHIPPED.warm_on_start and SHIPPED.enabled


def test_the_gate_reads_what_the_gateway_start_measured(make_config, tiny_model_dir, tmp_path):
    """`warm.start` as the gateway calls it: a niced child process writes the base's helpfulness
    answers and plain preference answers; a gate on a candidate then adds the candidate's own and the
    teacher's answers, and rewrites neither of the base's."""
    from test_gate import variant

    cfg = make_config(gate=small_gate_files(tmp_path))
    proc = warm.start(cfg)
    assert proc is not None and proc.wait(180) == 0
    log = (cfg.home / "run" / "warm-gate.log").read_text()
    assert "the base's gate references ready: helpfulness_s" in log, log
    cache = warm.gate_cache(cfg)
    before = stamps(cache)
    assert len(before) == 2, before  # the helpfulness answers, the plain preference answers
    t0 = time.monotonic()
    assert warm.warm_base(cfg, tiny_model_dir) and stamps(cache) == before  # found: nothing generated again
    assert time.monotonic() - t0 < 30

    nudged = variant(tiny_model_dir, tmp_path / "nudged",
                     lambda m: [p.add_(1e-4 * torch.randn_like(p)) for p in m.parameters()])
    gate = cfg.gate.model_copy(update={"doses": [1.0], "require_learning": False})
    for taught in ("", "Please keep replies under 30 words."):  # the helpfulness check; the preference measure
        evaluate_doses(gate, nudged, tiny_model_dir, tmp_path / "work", judged=[], base_dir=tiny_model_dir,
                       cache_dir=cache, taught=taught)
    after = stamps(cache)
    assert {k: after[k] for k in before} == before  # the base's figures were read, not written
    assert len(after) == len(before) + 2, after  # the candidate's helpfulness answers, the teacher's answers


def test_nothing_starts_when_off(make_config):
    assert warm.start(make_config()) is None  # configs/test.yaml: off, as the class default
