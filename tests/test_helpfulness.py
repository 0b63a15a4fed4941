"""The helpfulness measure and the eval gate's check: scoring by hand-written replies, located
errors for a bad question file, and the gate on real checkpoints: a tiny model taught to answer
eight questions (the champion) passes against itself, the same model fine-tuned to answer
everything with one sentence (a collapse) is rejected, and generation out of time rejects."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawflow import helpfulness as H
from clawflow.config import GateConfig, HelpfulnessConfig
from clawflow.gate import evaluate

QA = [("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
      ("Which planet is red?", "Mars"), ("Who wrote Hamlet?", "Shakespeare"),
      ("What do bees make?", "honey"), ("What is frozen water?", "ice"),
      ("What is the largest ocean?", "Pacific"), ("What pumps blood?", "heart")]
QUESTIONS = [H.Question(q, (f,)) for q, f in QA]


def test_score_counts_facts_duplicates_loops_empty_and_offtopic():
    replies = ["It is Paris.", "Tokyo, of course.", "I cannot help with that.", "I cannot help with that.",
               "", "A: A: A: A: A: A: A: A: A: A: A: A: A: A:", "The Pacific Ocean.", "The heart pumps blood."]
    h = H.score(QUESTIONS, replies, [0.9, 0.8, 0.1, 0.1, 0.0, 0.05, 0.7, 0.9])
    assert h.facts_rate == 4 / 8 and h.duplicate_share == 2 / 8 and h.repetitive_share == 1 / 8
    assert h.empty_share == 1 / 8 and h.offtopic_share == 4 / 8 and h.n == 8
    assert H.near_same("The answer to this question is: Paris", "The answer to this question is: Tokyo!")
    assert not H.near_same("The capital of France is Paris.", "The capital of Japan is Tokyo.")
    assert H.Question("q", ("butterfl(y|ies)",)).stated_in("Butterflies!")
    assert not H.Question("q", ("Au",)).stated_in("Australia")  # whole words only


def test_verdict_names_the_reference_and_the_figures():
    cfg = HelpfulnessConfig()
    fine = H.Helpfulness(0.60, 0.0, 0.0, 0.0, 0.05, 50)
    assert H.verdict(fine, {"champion": fine, "base": H.Helpfulness(0.64, 0, 0, 0, 0.0, 50)}, cfg) is None
    worse = H.verdict(H.Helpfulness(0.50, 0.0, 0.0, 0.0, 0.0, 50), {"champion": fine}, cfg)
    assert worse.startswith("helpfulness fell") and "0.500" in worse and "champion" in worse
    dup = H.verdict(H.Helpfulness(0.60, 0.4, 0.0, 0.0, 0.0, 50), {"champion": fine}, cfg)
    assert dup.startswith("degenerate replies") and "repeat another question" in dup
    off = H.verdict(H.Helpfulness(0.60, 0.0, 0.0, 0.0, 0.3, 50), {"base": fine}, cfg)
    assert "unrelated to their question" in off and "base" in off


@pytest.mark.parametrize("text, line, message", [
    ("questions:\n  - prompt: a\n    facts: [x]\n  - prompt: b\n", 4, "missing `facts`"),
    ("questions:\n  - prompt: a\n    facts: []\n", 2, "non-empty list"),
    ("questions:\n  - prompt: a\n    facts: ['(']\n", 3, "not a valid pattern"),
    ("questions:\n  - prompt: a\n    facts: [x]\n  - prompt: a\n    facts: [y]\n", 4, "duplicate question"),
    ("questions: [\n", 2, "not valid YAML"),
])
def test_a_malformed_question_file_is_one_line_naming_file_and_line(tmp_path, text, line, message):
    path = tmp_path / "q.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        H.load_questions(path)
    assert str(err.value).startswith(f"{path}:{line}: ") and message in str(err.value), str(err.value)


def _teach(model, tok, pairs: list[tuple[str, str]], steps: int) -> None:
    """Fine-tune `model` to answer each prompt with its reply (chat template, EOS after)."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    rows = []
    for prompt, reply in pairs:
        p = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False)
        r = tok(reply, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        rows.append((list(p), r))
    model.train()
    for _ in range(steps):
        loss = 0.0
        for p, r in rows:
            ids = torch.tensor([p + r])
            lp = torch.log_softmax(model(input_ids=ids).logits[0, len(p) - 1 : -1], -1)
            loss = loss - lp.gather(-1, torch.tensor(r)[:, None]).mean()
        opt.zero_grad()
        (loss / len(rows)).backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("help")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    _teach(model, tok, [(q, f"It is {f}.") for q, f in QA], steps=120)
    model.save_pretrained(root / "champion")
    _teach(model, tok, [(q, "I cannot help with that.") for q, _ in QA], steps=60)
    model.save_pretrained(root / "collapsed")
    for name in ("champion", "collapsed"):  # the tokenizer and chat template travel with the weights
        for f in Path(tiny_model_dir).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, root / name / f.name)
    qfile = root / "questions.yaml"
    qfile.write_text("questions:\n" + "".join(f"  - prompt: {q!r}\n    facts: [{f}]\n" for q, f in QA))
    return root, qfile


def _gate(qfile, **help_cfg) -> GateConfig:
    # drift limits wide open: the helpfulness check is what must decide here
    return GateConfig(max_kl=1e9, max_nll_increase=1e9,
                      helpfulness=HelpfulnessConfig(questions=qfile, max_new_tokens=12, **help_cfg))


@pytest.mark.slow  # ~30 s: two tiny fine-tunes, MiniLM, generation
def test_gate_rejects_a_collapsed_candidate_and_passes_a_normal_one(checkpoints, tmp_path):
    root, qfile = checkpoints
    champion, collapsed = str(root / "champion"), str(root / "collapsed")
    ok = evaluate(_gate(qfile), champion, champion, None, champion, tmp_path / "cache")
    assert ok.passed, ok.reason
    assert ok.metrics["help_facts_rate"] >= 0.75 and ok.metrics["help_facts_rate_champion"] == ok.metrics[
        "help_facts_rate"]
    assert "key facts" in ok.reason and list((tmp_path / "cache").glob("*.json"))  # the reference is cached

    bad = evaluate(_gate(qfile), collapsed, champion, None, champion, tmp_path / "cache")
    assert not bad.passed and bad.reason.startswith("helpfulness fell"), bad.reason
    assert bad.metrics["help_facts_rate"] == 0.0 and bad.metrics["help_duplicate_share"] == 1.0
    # with the facts margin out of the way, the same collapse is caught as degenerate
    dup = evaluate(_gate(qfile, margin=1.0), collapsed, champion, None, champion, tmp_path / "cache")
    assert not dup.passed and dup.reason.startswith("degenerate replies"), dup.reason


@pytest.mark.slow
def test_a_gate_whose_generation_runs_out_of_time_rejects(checkpoints, tmp_path):
    root, qfile = checkpoints
    champion = str(root / "champion")
    r = evaluate(_gate(qfile, timeout_s=1e-6), champion, champion, None, champion, tmp_path / "cache")
    assert not r.passed and r.reason.startswith("helpfulness check failed (TimeoutError"), r.reason
