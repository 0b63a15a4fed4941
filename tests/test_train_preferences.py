"""Standing preferences in the trainer: every run distils them over freshly drawn general prompts,
reads each in its strongest words, and keeps a corrected turn's own content hint beside them."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoTokenizer

from clawflow.config import REPO_ROOT, load_config
from clawflow.contracts.sample import SCHEMA as SAMPLE_SCHEMA
from clawflow.train.checkpoint import META_FILE
from clawflow.train.plan import broad_items, teaching
from clawflow.train.prompts import load_prompts
from clawflow.train.recipe import PREFERENCES_REPORT
from clawflow.train.rewrite_choice import degenerate
from tests.test_train_distill import CONVERSATIONS, MAX_TOKENS
from tests.test_train_opd import encode

import _recipe_here as recipe_here

# requests of function words only: a random model's answers are never judged off the request
PROMPTS = ["What is it?", "Can you do that?", "How would that be?", "Why is it so?", "What about this one?",
           "Is that it?"]


def _prompts_file(tmp_path):
    f = tmp_path / "prompts.yaml"
    f.write_text(yaml.safe_dump({"prompts": [{"prompt": p, "kind": "smalltalk"} for p in PROMPTS]}))
    return f


def test_degenerate_teacher_answers():
    qs = ["What is the capital of Canada?", "Which gas do plants absorb?", "Who wrote Hamlet?", "What is H2O?"]
    assert degenerate(qs, ["Ottawa is the capital of Canada.", "Plants absorb carbon dioxide gas.",
                           "Shakespeare wrote Hamlet.", "H2O is water."]) is None
    assert "empty or off" in degenerate(qs, ["", "", "Shakespeare wrote Hamlet.", " "])
    assert "empty or off" in degenerate(qs, ["I'm sorry for any confusion."] * 4)


def test_broad_items_are_a_fresh_sample_per_run_and_read_the_preferences(tiny_model_dir, tmp_path):
    from clawflow.config import TrainConfig

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = TrainConfig(broad_prompts=3, broad_prompts_file=_prompts_file(tmp_path))
    taught = teaching([{"text": "Answer in at most 20 words"}, {"text": "Always end with a question."}], 4)
    assert taught == "Answer in at most 20 words. Always end with a question."
    a, b = broad_items(cfg, taught, tok, 10, seed=1), broad_items(cfg, taught, tok, 10, seed=2)
    assert [it.index for it in a] == [10, 11, 12] and all(it.broad and it.rewrite and it.hint == taught for it in a)
    assert {it.request for it in a} != {it.request for it in b}  # another run, other prompts
    assert taught in tok.decode(a[0].teacher_prompt) and taught not in tok.decode(a[0].prompt)
    assert broad_items(cfg, "", tok, 0, 1) == []  # nothing standing: nothing to distil
    assert len(load_prompts()) >= 300  # the shipped set


def _one_corrected_turn(model_dir: str, tmp_path: Path, hint: str) -> Path:
    """A batch of one turn judged −1 with `hint`, as the flow writes it."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    messages, _ = CONVERSATIONS[0]
    row = {"turn_id": "t0", "prompt_token_ids": encode(tok, messages), "response_logprobs": [-1.0] * 4,
           "response_token_ids": [tok.convert_tokens_to_ids(".")] * 4, "reward": -1.0, "hint": hint,
           "messages": json.dumps(messages), "tools": None, "group_id": None, "policy_version": 0}
    batch = tmp_path / "samples.parquet"
    pq.write_table(pa.Table.from_pylist([row], schema=SAMPLE_SCHEMA), batch)
    return batch


@pytest.mark.slow  # a training run
def test_a_run_distils_standing_preferences_and_reports_their_strengths(tiny_model_dir, tmp_path):
    batch = _one_corrected_turn(tiny_model_dir, tmp_path, "No, it was in 1945.")
    prefs = [{"pref_id": "p-1", "text": "Too wordy.", "variants": ["Too wordy.", "Answer in at most 20 words."]},
             {"pref_id": "p-2", "text": "Always end your reply with a question.",
              "variants": ["Always end your reply with a question."]}]
    pfile = tmp_path / "prefs.json"
    pfile.write_text(json.dumps(prefs))
    qfile = tmp_path / "questions.yaml"  # the hint-strength and degeneracy probes
    qfile.write_text(yaml.safe_dump({"questions": [{"prompt": p, "facts": [".*"]} for p in PROMPTS[:4]]}))
    # the flow's task passes --preferences (tasks/training.py train_policy); so does this test
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["home"] = str(tmp_path / "home")
    raw["train"].update(micro_batch=2, lr=3e-3, epochs=2, objective="distill", rewrite_max_tokens=MAX_TOKENS,
                        rewrite_samples=1, broad_prompts=4, broad_prompts_file=str(_prompts_file(tmp_path)),
                        rehearsal_prompts=str(qfile), rehearsal=0)
    cfg_path = tmp_path / "prefs.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "prefs-out"
    metrics = recipe_here.train(cfg_path, load_config(cfg_path), Path(tiny_model_dir), batch, out,
                                frozen_base=Path(tiny_model_dir), preferences=pfile)
    meta = json.loads((out / META_FILE).read_text())
    assert meta["counts"]["broad"] == 4
    report = json.loads((out / PREFERENCES_REPORT).read_text())
    assert set(report["strengths"]) == {"Too wordy.", "Answer in at most 20 words.",
                                        "Always end your reply with a question."}
    strongest = max(["Too wordy.", "Answer in at most 20 words."], key=report["strengths"].get)
    chosen = {p["pref_id"]: p["text"] for p in report["preferences"]}
    assert chosen == {"p-1": strongest, "p-2": "Always end your reply with a question."}  # each in its strongest words
    assert [p["strength"] for p in report["preferences"]] == sorted((p["strength"] for p in report["preferences"]),
                                                                    reverse=True)
    kept = [p["text"] for p in report["preferences"] if p["text"] not in {d["text"] for d in report["dropped"]}]
    assert report["taught"] == " ".join(t if t.endswith(".") else t + "." for t in kept)
    log = (tmp_path / "prefs-out.log").read_text()
    assert "the teacher reads" in log and "general prompts distil the standing preferences" in log
    assert metrics["steps"] >= 1

    # the policy moved toward the preference it was taught: the gate's measure (the teacher's answers
    # from the plain prompt, candidate vs start) is positive
    from clawflow.helpfulness import load_model
    from clawflow.policy import preference_probe as P

    base, tok = load_model(tiny_model_dir)
    trained, _ = load_model(out)
    answers = P.teacher_answers(base, tok, PROMPTS, report["taught"], MAX_TOKENS)
    assert P.gain(P.answer_loglik(base, tok, PROMPTS, answers), P.answer_loglik(trained, tok, PROMPTS, answers)) > 0


@pytest.mark.slow  # a training run that ends before its first step
def test_a_correction_its_teacher_never_shows_teaches_nothing(tiny_model_dir, tmp_path):
    """`train.verify_stances` (shipped on). The hint-following model (tests/hint_following.py) answers
    every prompt that carries a hint with its 7-word SHORT reply, which never ends with a question: no
    rewrite whose teacher read "Always end your reply with a question." shows it (the corrected turn's
    and the rehearsal questions'). None is learned: they would teach what the hint did to the teacher
    (SHORT), not what it asks. So the run trains nothing, and its log names the stance that went
    unshown. With the check off the same run trains on them; tests/test_shipped_recipe.py runs it on,
    where a length correction is shown and trained."""
    from hint_following import build

    from clawflow.train.launch import EXIT_NO_SAMPLES, TrainingError

    model = str(build(tiny_model_dir, tmp_path / "hint-following", steps=80))
    batch = _one_corrected_turn(model, tmp_path, "Always end your reply with a question.")
    qfile = tmp_path / "questions.yaml"
    qfile.write_text(yaml.safe_dump({"questions": [{"prompt": p, "facts": [".*"]} for p in PROMPTS[:2]]}))
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["home"] = str(tmp_path / "home")
    raw["train"].update(micro_batch=2, objective="distill", rewrite_max_tokens=MAX_TOKENS, rewrite_samples=1,
                        broad_prompts=0, rehearsal_prompts=str(qfile), rehearsal=2)
    for verify in (True, False):
        raw["train"]["verify_stances"] = verify
        cfg_path = tmp_path / f"verify-{verify}.yaml"
        cfg_path.write_text(yaml.safe_dump(raw))
        out = tmp_path / f"verify-{verify}-out"
        if verify:
            with pytest.raises(TrainingError) as failed:
                recipe_here.train(cfg_path, load_config(cfg_path), Path(model), batch, out)
            assert failed.value.returncode == EXIT_NO_SAMPLES, failed.value
        else:
            assert recipe_here.train(cfg_path, load_config(cfg_path), Path(model), batch, out)["steps"] >= 1
        log = out.with_name(out.name + ".log").read_text()
        # the corrected turn and the 2 rehearsal questions, each rewritten with the hint and answered SHORT
        assert ('by stance: {"closing/question": 3}' in log) is verify, log[-2000:]
        assert ("not showing what its teacher read): nothing to train on" in log) is verify


@pytest.mark.slow  # a prepare step
def test_a_prepare_step_with_no_usable_rewrite_succeeds_and_keeps_what_it_wrote(tiny_model_dir, tmp_path):
    """When none of the next run's prepared rewrites is usable (here no rehearsal answer can state its
    fact) the prepare step still succeeds: the next run trains on its own corrected turns and reads
    what was written instead of writing it again. It had failed with "nothing to train on"."""
    from clawflow.train.rewrite_cache import RewriteCache

    pfile = tmp_path / "prefs.json"
    pfile.write_text(json.dumps([{"pref_id": "p-1", "text": "Too wordy.", "variants": ["Too wordy!"]}]))
    qfile = tmp_path / "questions.yaml"
    qfile.write_text(yaml.safe_dump({"questions": [{"prompt": p, "facts": ["(?!)"]}  # a fact nothing states
                                                   for p in ("Who is that?", "Where is it?")]}))
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["home"] = str(tmp_path / "home")
    raw["train"].update(objective="distill", rewrite_max_tokens=MAX_TOKENS, rewrite_samples=1, broad_prompts=0,
                        rehearsal_prompts=str(qfile), rehearsal=2)
    raw["gate"]["enabled"] = False
    cfg_path = tmp_path / "prefs.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    cfg, cache_dir = load_config(cfg_path), tmp_path / "rewrites"

    log = recipe_here.prepare(cfg_path, cfg, Path(tiny_model_dir), pfile, cache_dir, parent_version=0, broad_seed=7)
    assert "prepared 0 usable rewrites for the next run" in log.read_text()
    assert len(RewriteCache(cache_dir, tiny_model_dir, cfg.train).data["replies"]) == 2


@pytest.mark.slow  # a prepare step and two training runs
def test_the_prepare_step_writes_the_rewrites_the_next_run_reads(tiny_model_dir, tmp_path):
    """`recipe --prepare` (the flow's prepare-next-run, after a promotion) writes the next run's
    general-prompt rewrites and preference strengths; the next run from the same weights, drawing
    the same prompts, reuses them instead of generating; other weights find nothing."""
    from clawflow.train.rewrite_cache import RewriteCache

    batch = _one_corrected_turn(tiny_model_dir, tmp_path, "Too wordy.")
    # wordings a random model answers under with something (not degenerate: train/rewrite_choice.py)
    prefs = [{"pref_id": "p-1", "text": "Too wordy.", "variants": ["Too wordy!"]}]
    pfile = tmp_path / "prefs.json"
    pfile.write_text(json.dumps(prefs))
    qfile = tmp_path / "questions.yaml"
    qfile.write_text(yaml.safe_dump({"questions": [{"prompt": p, "facts": [".*"]} for p in  # not the general prompts
                                                   ("Who is that?", "Where is it?", "When was that?", "Which one?")]}))
    raw = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    raw["home"] = str(tmp_path / "home")
    raw["train"].update(micro_batch=2, lr=3e-3, epochs=1, objective="distill", rewrite_max_tokens=MAX_TOKENS,
                        rewrite_samples=1, broad_prompts=4, broad_prompts_file=str(_prompts_file(tmp_path)),
                        rehearsal_prompts=str(qfile), rehearsal=2)
    cfg_path = tmp_path / "prefs.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    cfg, cache_dir = load_config(cfg_path), tmp_path / "rewrites"

    recipe_here.prepare(cfg_path, cfg, Path(tiny_model_dir), pfile, cache_dir, parent_version=0, broad_seed=7,
                        gate_cache=tmp_path / "gate")
    kept = RewriteCache(cache_dir, tiny_model_dir, cfg.train)
    assert len(kept.data["replies"]) == 6  # 2 rehearsal questions + 4 general prompts
    assert len(kept.data["strengths"]) == 1
    # the gate finds the teacher's answers for these weights and what they taught
    from clawflow.policy import preference_probe as P

    taught, g = list(kept.data["strengths"].values())[0]["taught"], cfg.gate
    assert g.enabled and taught
    for text in (taught, ""):  # the teacher's answers, and the champion's plain ones
        found = P.cached_answers(tmp_path / "gate", tiny_model_dir, P.load_prompts(g.preference_prompts), text,
                                 g.preference_max_tokens, lambda: pytest.fail("the gate's answers were not prepared"))
        assert len(found) == len(P.load_prompts(g.preference_prompts))
    assert RewriteCache(cache_dir, tmp_path, cfg.train).data["replies"] == {}  # other weights: nothing

    out = tmp_path / "next-run"
    metrics = recipe_here.train(cfg_path, cfg, Path(tiny_model_dir), batch, out, preferences=pfile,
                                cache_dir=cache_dir, broad_seed=7)
    log = (tmp_path / "next-run.log").read_text()
    assert "6 rewrites written before with these weights, reused" in log
    assert "preference strengths measured before with these weights, reused" in log
    assert "rewrote 1 replies" in log  # only the corrected turn was generated
    report = json.loads((out / PREFERENCES_REPORT).read_text())
    assert report == list(kept.data["strengths"].values())[0]
    assert metrics["steps"] >= 1
    # the run added its own rewrite (the corrected turn) to what the next run from these weights finds
    assert len(RewriteCache(cache_dir, tiny_model_dir, cfg.train).data["replies"]) == 7

    # a later correction brings a new wording of the same preference: the general prompts' and
    # rehearsal answers written for it are still reused (they are kept under the preference's id)
    prefs[0]["variants"] = ["Too wordy."]  # the only wording left: the teacher reads it
    pfile.write_text(json.dumps(prefs))
    recipe_here.train(cfg_path, cfg, Path(tiny_model_dir), batch, tmp_path / "third-run", preferences=pfile,
                      cache_dir=cache_dir, broad_seed=7)
    log = (tmp_path / "third-run.log").read_text()
    assert "preference strengths measured before" not in log  # a new wording: measured again
    assert "the teacher reads 'Too wordy.'" in log
    assert "6 rewrites written before with these weights, reused" in log
    assert "rewrote 1 replies" in log  # the corrected turn reads the new words: written again
