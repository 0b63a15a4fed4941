"""The helpfulness measure and the eval gate's check: scoring of hand-written replies, located errors
for a bad question file, and the gate on real checkpoints: a tiny model taught to answer eight
questions (the champion); a LoRA adapter on it that still answers passes; the champion fine-tuned
to answer everything with one sentence (a collapse) is rejected; generation out of time rejects."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawflow import helpfulness as H
from clawflow.config import REPO_ROOT, GateConfig, HelpfulnessGateConfig
from clawflow.policy.gate import evaluate

QA = [("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
      ("Which planet is red?", "Mars"), ("Who wrote Hamlet?", "Shakespeare"),
      ("What do bees make?", "honey"), ("What is frozen water?", "ice"),
      ("What is the largest ocean?", "Pacific"), ("What pumps blood?", "heart")]
QUESTIONS = [H.Question(q, [f]) for q, f in QA]
COLLAPSE = "I cannot help with that."


def test_score_counts_facts_duplicates_loops_empty_and_offtopic():
    replies = ["It is Paris.", "Tokyo, of course.", COLLAPSE, COLLAPSE,
               "", "A: A: A: A: A: A: A: A: A: A: A: A: A: A:", "The Pacific Ocean.", "The heart pumps blood."]
    h = H.score(QUESTIONS, replies, [0.9, 0.8, 0.1, 0.1, 0.0, 0.05, 0.7, 0.9], offtopic_threshold=0.3)
    assert (h.facts_rate, h.duplicate_share, h.repetitive_share, h.empty_share, h.offtopic_share, h.n) == (
        4 / 8, 2 / 8, 1 / 8, 1 / 8, 4 / 8, 8)
    assert H.score(QUESTIONS, replies).offtopic_share == 0.0  # no relevance given: not measured
    assert h.as_metrics("help_")["help_facts_rate"] == 0.5 and "help_replies" not in h.as_metrics()


def test_near_same_catches_templates_not_parallel_answers():
    assert H.near_same("I'm sorry for any misunderstanding.", "I'm sorry for any misinterpretation!")
    assert H.near_same("You're a helpful AI named SmolLM, trained by Hugging Face to answer tides",
                       "You're a helpful AI named SmolLM, trained by Hugging Face. Earthquakes?")
    assert not H.near_same("The capital of France is Paris.", "The capital of Japan is Tokyo.")
    assert not H.near_same("The chemical symbol for gold is Au.", "The chemical symbol for sodium is Na.")
    assert H.loops("A: A: A: A: A: A: A: A: A: A: A: A: A:") and not H.loops("Paris is the capital of France.")


def test_facts_match_whole_words_any_alternative_case_insensitive():
    assert H.Question("q", ["butterfl(y|ies)", "moths?"]).stated_in("They become MOTHS.")
    assert not H.Question("q", ["Au"]).stated_in("Australia")
    assert H.Question("q", ["hydrogen.*oxygen"]).stated_in("Hydrogen and oxygen.")


def test_verdict_names_the_reference_and_the_figures():
    cfg = HelpfulnessGateConfig()

    def h(facts=0.6, dup=0.0, off=0.0, rep=0.0, empty=0.0):
        return H.Helpfulness(facts, dup, off, rep, empty, 50)

    assert H.verdict(h(), {"champion": h(), "base": h(0.64)}, cfg) is None
    worse = H.verdict(h(0.5), {"champion": h()}, cfg)
    assert worse.startswith("helpfulness fell") and "0.500" in worse and "0.600 for the champion" in worse
    assert "repeat another question" in H.verdict(h(dup=0.4), {"champion": h()}, cfg)
    assert "loop" in H.verdict(h(rep=0.3), {"champion": h()}, cfg)
    assert "empty" in H.verdict(h(empty=0.2), {"champion": h()}, cfg)
    off = H.verdict(h(off=0.3), {"base": h(off=0.02)}, cfg)
    assert "unrelated to their question" in off and "0.020 for the base" in off


@pytest.mark.parametrize("text, line, message", [
    ("questions:\n  - prompt: a\n    facts: [x]\n  - prompt: b\n", 4, "missing `facts`"),
    ("questions:\n  - facts: [x]\n", 2, "missing `prompt`"),
    ("questions:\n  - prompt: a\n    facts: []\n", 3, "non-empty list"),
    ("questions:\n  - prompt: a\n    facts: ['(']\n", 3, "not a valid pattern"),
    ("questions:\n  - prompt: a\n    facts: [x]\n  - prompt: a\n    facts: [y]\n", 4, "duplicate question"),
    ("questions: [\n", 2, "not valid YAML"),
    ("- just a list\n", 1, "expected a mapping"),
])
def test_a_malformed_question_file_is_one_line_naming_file_and_line(tmp_path, text, line, message):
    path = tmp_path / "q.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        H.load_questions(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:{line}: ") and message in msg and "\n" not in msg, msg


def test_the_shipped_questions_are_many_valid_and_never_training_prompts():
    questions = H.load_questions()
    assert len(questions) >= 48 and H.load_questions(H.DEFAULT_FILE) == questions
    header = H.DEFAULT_FILE.read_text()
    assert header.startswith("#") and "never used for training" in header.lower()

    def strings(node):
        if isinstance(node, str):
            yield node.strip().lower()
        elif isinstance(node, dict):
            for v in node.values():
                yield from strings(v)
        elif isinstance(node, list):
            for v in node:
                yield from strings(v)

    envs = (REPO_ROOT / "configs" / "envs").glob("*.yaml")
    training = {s for f in envs for s in strings(yaml.safe_load(f.read_text()))}
    assert not [q.prompt for q in questions if q.prompt.strip().lower() in training]


def _teach(model, tok, pairs: list[tuple[str, str]], steps: int, lr: float) -> None:
    """Fine-tune `model` (all its trainable weights) to answer each prompt with its reply: every step
    the mean over pairs of the reply's mean token NLL, all pairs in one right-padded forward (one
    forward per pair, over the whole vocabulary at every position, made this module's fixture 48 s)."""
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    rows = []
    for prompt, reply in pairs:
        p = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False)
        r = tok(reply, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        rows.append((list(p), r))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask, target = torch.zeros_like(ids), torch.zeros_like(ids)
    weight = torch.zeros(len(rows), width)  # at the position that predicts each reply token: 1/len(reply)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, : len(p) + len(r)] = 1
        target[i, len(p) - 1 : len(p) + len(r) - 1] = torch.tensor(r)
        weight[i, len(p) - 1 : len(p) + len(r) - 1] = 1.0 / len(r)
    at = weight > 0
    model.train()
    for _ in range(steps):
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        lp = torch.log_softmax(model.get_output_embeddings()(hidden[at]), -1)  # the vocabulary only where learned
        loss = -(lp.gather(-1, target[at][:, None])[:, 0] * weight[at]).sum() / len(rows)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _copy_tokenizer(src: str, dst: Path) -> None:
    for f in Path(src).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, dst / f.name)


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    """champion: the tiny model taught the eight answers; normal: a LoRA adapter on the champion
    (the default config trains LoRA) taught the same answers a little more; collapsed: the champion
    fine-tuned to answer every question with one sentence."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("help")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    answers = [(q, f"It is {f}.") for q, f in QA]
    _teach(model, tok, answers, steps=80, lr=3e-3)
    model.save_pretrained(root / "champion")
    lora = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    lora.peft_config["default"].base_model_name_or_path = str(root / "champion")
    _teach(lora, tok, answers, steps=5, lr=1e-3)
    lora.save_pretrained(root / "normal")
    model = lora.unload().requires_grad_(True)  # the champion's weights, untouched by the adapter
    _teach(model, tok, [(q, COLLAPSE) for q, _ in QA], steps=60, lr=3e-3)
    model.save_pretrained(root / "collapsed")
    for name in ("champion", "normal", "collapsed"):
        _copy_tokenizer(tiny_model_dir, root / name)
    qfile = root / "questions.yaml"
    qfile.write_text("questions:\n" + "".join(f"  - prompt: {q!r}\n    facts: [{f}]\n" for q, f in QA))
    return str(root / "champion"), str(root / "normal"), str(root / "collapsed"), qfile


def _gate(qfile, **help_cfg) -> GateConfig:
    # drift limits wide open: the helpfulness check is what must decide here
    return GateConfig(max_kl=1e9, max_nll_increase=1e9,
                      helpfulness=HelpfulnessGateConfig(questions=qfile, max_new_tokens=12, **help_cfg))


def test_measure_loads_an_adapter_and_caches_its_replies(checkpoints, tmp_path):
    _, normal, collapsed, qfile = checkpoints
    questions = H.load_questions(qfile)
    h = H.measure(normal, questions, 12, threads=1, cache_dir=tmp_path)
    assert h.facts_rate == 1.0 and h.duplicate_share == 0.0 and h.replies[0] == "It is Paris.", h.replies
    assert len(list(tmp_path.glob("*.json"))) == 1
    # cached: a deadline already past does not matter, nothing is generated again
    assert H.measure(normal, questions, 12, deadline=time.monotonic() - 1, cache_dir=tmp_path) == h
    with pytest.raises(TimeoutError):  # another token budget is another key: generation, out of time
        H.measure(normal, questions, 13, deadline=time.monotonic() - 1, cache_dir=tmp_path)
    c = H.measure(collapsed, questions, 12)
    # near-same counts: the collapse also says "I cannot with with that."
    assert c.facts_rate == 0.0 and c.duplicate_share == 1.0 and COLLAPSE in c.replies, c.replies


def test_gate_rejects_a_collapsed_candidate_and_passes_a_normal_one(checkpoints, tmp_path):
    champion, normal, collapsed, qfile = checkpoints
    cache = tmp_path / "cache"
    ok = evaluate(_gate(qfile), normal, champion, None, champion, cache)
    assert ok.passed, ok.reason
    m = ok.metrics
    assert m["help_facts_rate"] >= 0.75 and m["help_facts_rate_champion"] == m["help_facts_rate_base"] == m[
        "help_facts_rate"] and m["help_duplicate_share"] == 0.0
    assert "key facts" in ok.reason and list(cache.glob("*.json"))  # the reference is cached

    bad = evaluate(_gate(qfile), collapsed, champion, None, champion, cache)
    assert not bad.passed and bad.reason.startswith("helpfulness fell"), bad.reason
    assert bad.metrics["help_facts_rate"] == 0.0 and bad.metrics["help_duplicate_share"] == 1.0
    # with the facts margin out of the way, the same collapse is caught as degenerate
    dup = evaluate(_gate(qfile, margin=1.0), collapsed, champion, None, champion, cache)
    assert not dup.passed and dup.reason.startswith("degenerate replies") and "repeat" in dup.reason, dup.reason


def test_a_gate_whose_generation_runs_out_of_time_rejects(checkpoints, tmp_path):
    champion, normal, _, qfile = checkpoints
    r = evaluate(_gate(qfile, timeout_s=1e-6), normal, champion, None, champion, tmp_path / "cache")
    assert not r.passed and r.reason.startswith("helpfulness check failed (TimeoutError"), r.reason


def test_paired_counts_show_a_swap_two_rates_hide():
    from clawflow.config import HelpfulnessGateConfig
    from clawflow.helpfulness import Question, paired, score, verdict

    qs = [Question(f"What is thing {k}?", [f"fact{k}"]) for k in range(20)]
    ref = score(qs, [f"It is fact{k}." if k < 10 else "No idea." for k in range(20)])
    swapped = score(qs, [f"It is fact{k}." if k >= 10 else "No idea." for k in range(20)])
    assert ref.facts_rate == swapped.facts_rate == 0.5
    assert paired(swapped, ref) == (10, 10)
    worse = score(qs, [f"It is fact{k}." if k < 7 else "No idea." for k in range(20)])
    assert paired(worse, ref) == (3, 0)
    why = verdict(worse, {"champion": ref}, HelpfulnessGateConfig(margin=0.1))
    assert why is not None and "3 questions lost, 0 gained" in why
