"""Environments: persona checks and feedback, the terminal sandbox, and episodes through a real
gateway that become turns paired with their next states."""

from __future__ import annotations

import json
import random
import time
import uuid
from pathlib import Path

import httpx
import pytest

from clawflow.config import EnvConfig
from clawflow.envs import build_envs
from clawflow.envs.base import pace_s
from clawflow.envs.collect import Totals, collect_round, gateway_healthy
from clawflow.envs.personas import PersonaEnv, check, feedback, load_personas
from clawflow.envs.rewards import read_env_rewards
from clawflow.envs.sandbox import Sandbox, refusal
from clawflow.envs.terminal import TerminalEnv, load_tasks, tool_result
from clawflow.store.catalog import Catalog
from tests.conftest import admin, running_gateway
from _store_helpers import pending_pairs

PERSONAS, WORDING = load_personas()
BY_NAME = {p.name: p for p in PERSONAS}


def test_preference_checks_are_functions_of_the_reply():
    assert check("max_words", 5, "one two three four five")
    assert not check("max_words", 5, "one two three four five six")
    assert check("bullet_list", True, "- apples\n- pears\n\n* plums")
    assert not check("bullet_list", True, "Here you go:\n- apples\n- pears")
    assert not check("bullet_list", True, "- only one")
    assert check("numbered_list", True, "1. boil water\n2) add tea")
    assert check("ends_with_question", True, "Sounds good. Want more?  ")
    assert not check("ends_with_question", True, "Is it? Yes.")
    assert check("all_lowercase", True, "sure, here it is.")
    assert not check("all_lowercase", True, "Sure, here it is.")
    assert not check("all_lowercase", True, "123 ...")  # no letters: not a lowercase reply
    assert check("formal", True, "I do not recommend it.")
    assert not check("formal", True, "I don't recommend it.")
    assert not check("formal", True, "I do not recommend it!")
    assert not check("forbidden_words", ["delve", "as an ai"], "Let me DELVE into it")
    assert not check("forbidden_words", ["delve", "as an ai"], "As an AI, I cannot")
    assert check("forbidden_words", ["delve"], "delved is a different word")
    assert not check("max_words", 30, "   ")  # an empty reply satisfies nothing
    terse = BY_NAME["terse"]
    assert terse.hit("Paris.")
    assert [p.kind for p in terse.failed("Certainly! " + "word " * 40)] == ["max_words", "forbidden_words"]


def test_feedback_in_both_directions_with_varied_wording():
    bullets = BY_NAME["bullets"]
    good, bad = "- rest\n- read a book\n- call a friend", "You could rest, read a book, or call a friend."
    seen_ok, seen_vague, seen_concrete = set(), set(), set()
    for seed in range(30):
        ok = feedback(bullets, WORDING, good, random.Random(seed), concrete_p=0.5)
        assert ok.satisfied and ok.text in WORDING.satisfied and not ok.failed
        seen_ok.add(ok.text)
        vague = feedback(bullets, WORDING, bad, random.Random(seed), concrete_p=0.0)
        assert not vague.satisfied and vague.failed == ["bullet_list"] and not vague.concrete
        assert vague.text in WORDING.vague["bullet_list"]
        seen_vague.add(vague.text)
        concrete = feedback(bullets, WORDING, bad, random.Random(seed), concrete_p=1.0)
        assert concrete.concrete and "bullet" in concrete.text.lower()
        seen_concrete.add(concrete.text)
    assert len(seen_ok) >= 3 and len(seen_vague) >= 2 and len(seen_concrete) >= 2
    # A concrete correction states the preference's value.
    long = feedback(BY_NAME["terse"], WORDING, "word " * 31, random.Random(0), concrete_p=1.0)
    assert "30" in long.text and long.failed == ["max_words"]


def test_persona_episode_moves_on_when_satisfied_and_scores_hit_rate():
    env = PersonaEnv(load_personas(names=["terse"]), EnvConfig(concrete_feedback=1.0))
    rng = random.Random(1)
    ep = env.start(rng)
    assert ep.messages[-1]["role"] == "user" and ep.messages[-1]["content"] in BY_NAME["terse"].prompts
    step = env.step(ep, {"role": "assistant", "content": "Short answer."}, rng)
    assert not step.done and step.messages[0]["role"] == "user"
    assert any(s in step.messages[0]["content"] for s in WORDING.satisfied)  # satisfied, then a new prompt
    step = env.step(ep, {"role": "assistant", "content": "word " * 50}, rng)
    assert "30" in step.messages[0]["content"]
    assert env.outcome(ep) == 0.5
    with pytest.raises(ValueError, match="unknown persona"):
        load_personas(names=["nobody"])


def test_sandbox_refuses_paths_outside_it(tmp_path):
    box = Sandbox(timeout_s=5)
    outside = Path("/tmp") / f"clawflow-escape-{uuid.uuid4().hex}"
    try:
        for cmd in [f"echo x > {outside}", "echo x > ../escape.txt", "cd .. && touch escape.txt",
                    "cp ~/.bashrc here", "ls /", f'echo x >"{outside}"']:
            res = box.run(cmd)
            assert res.refused and res.exit_code is None, cmd
            assert res.render().startswith("refused:")
        assert not outside.exists() and not (box.dir.parent / "escape.txt").exists()
        for cmd in ["sed 's/ /_/g' a.txt", "awk -F/ '{print $1}' a.txt", "cat a.txt 2>/dev/null", "mkdir -p d/e"]:
            assert refusal(cmd) is None, cmd
        res = box.run("echo inside > in.txt && cat in.txt")
        assert res.exit_code == 0 and res.output == "inside\n" and (box.dir / "in.txt").read_text() == "inside\n"
    finally:
        box.close()
    assert not box.dir.exists()


def test_sandbox_kills_a_command_past_its_time_limit():
    box = Sandbox(timeout_s=0.5)
    try:
        t0 = time.monotonic()
        # A background child in the same process group must die too: it would write late.txt.
        res = box.run("(sleep 1.5; echo late > late.txt) & sleep 30")
        assert res.timed_out and res.exit_code is None and time.monotonic() - t0 < 3
        assert "[killed: time limit]" in res.render()
        time.sleep(1.6)
        assert not (box.dir / "late.txt").exists()
    finally:
        box.close()


def test_sandbox_caps_output():
    box = Sandbox(timeout_s=1.0, output_cap=1000)
    try:
        res = box.run("yes a | head -c 200000")
        assert res.exit_code == 0 and res.truncated and len(res.output) == 1000 and res.output == "a\n" * 500
        res = box.run("yes")  # endless output: capped, then killed at the limit
        assert res.timed_out and res.truncated and len(res.output) == 1000
        assert box.run("echo small").truncated is False
    finally:
        box.close()


def test_terminal_tasks_are_solvable_and_not_presolved():
    tasks = load_tasks()
    assert len(tasks) >= 20
    for task in tasks:
        box = Sandbox(timeout_s=5)
        try:
            box.write(task.files)
            assert not task.passed(box, ""), task.name
            res = box.run(task.solution)
            assert res.exit_code == 0, (task.name, res.render())
            assert task.passed(box, res.output.strip()), task.name
        finally:
            box.close()


def test_terminal_tool_results_are_next_states():
    env = TerminalEnv(load_tasks(), EnvConfig())
    rng = random.Random(0)
    ep = env.start(rng)
    try:
        assert ep.tools[0]["function"]["name"] == "run_shell"
        call = {"id": "call_1", "type": "function",
                "function": {"name": "run_shell", "arguments": json.dumps({"command": "echo $((6*7))"})}}
        step = env.step(ep, {"role": "assistant", "content": None, "tool_calls": [call]}, rng)
        assert not step.done and step.messages == [{"role": "tool", "tool_call_id": "call_1",
                                                    "content": "42\n[exit code 0]"}]
        bad = tool_result(ep.data["box"], {"id": "c2", "function": {"name": "run_shell", "arguments": "ls"}})
        assert bad["content"].startswith("error: arguments must be JSON")
        step = env.step(ep, {"role": "assistant", "content": "done"}, rng)
        assert step.done and env.outcome(ep) == 0.0  # nothing was solved
    finally:
        env.close(ep)
    assert not ep.data["box"].dir.exists()


def test_pace_and_totals():
    assert pace_s(6, 10.0, 6.0) == 50.0 and pace_s(6, 90.0, 6.0) == 0.0


def test_episodes_through_gateway_become_pairs_with_next_states(make_config):
    cfg = make_config(envs={"environments": ["persona", "terminal"], "max_turns": 3, "group_n": 2,
                            "max_tokens": 8, "concurrency": 3},
                      serving={"threads": 1})  # 1 torch thread: far faster on a busy 2-core box
    envs = build_envs(cfg)
    assert not gateway_healthy(cfg)
    with running_gateway(cfg):
        assert gateway_healthy(cfg)
        results = collect_round(cfg, envs, 4, random.Random(0))  # 2 persona + 2 terminal episodes
        again = collect_round(cfg, envs, 4, random.Random(0))  # same seed: the same sampled replies
        httpx.post(f"{cfg.gateway_url}/admin/seal", headers=admin(cfg), timeout=60).raise_for_status()
    assert [r.error for r in results + again] == [None] * 8
    replies = [[x["response_text"] for x in r.rewards] for r in results]
    assert replies == [[x["response_text"] for x in r.rewards] for r in again]
    assert len({t for r in replies for t in r}) > 1  # sampled, not one greedy reply
    ours = {r.session_id for r in results}
    persona = [r for r in results if r.env == "persona"]
    assert [(r.turns, r.next_states) for r in persona] == [(3, 2), (3, 2)]
    pairs = pending_pairs(Catalog(cfg.home / "catalog.duckdb", cfg.home / "shards"), 100)
    by_session = {}
    for p in pairs:
        if p.session_id in ours:  # the repeat round's pairs aside
            by_session.setdefault(p.session_id, []).append(p)
    assert set(by_session) == {r.session_id for r in persona}  # terminal episodes: no tool call, no pair
    for session, ps in by_session.items():
        assert {p.source for p in ps} == {"persona"}
        assert sorted(p.turn_index for p in ps) == [0, 0, 1]  # turn 0 is a group of 2 choices
        assert {p.next_role for p in ps} == {"user"}
        first = [p for p in ps if p.turn_index == 0]
        assert first[0].group_id and first[0].group_id == first[1].group_id
        second = next(p for p in ps if p.turn_index == 1)
        feedback_text = json.loads(second.next_state)[0]["content"]
        assert feedback_text  # the persona's words, recorded as the turn's next state
    # Outcome rewards beside the turns: each group member scored, each episode's outcome.
    rows = read_env_rewards(cfg.home)
    for r in persona:
        mine = [x for x in rows if x["session_id"] == r.session_id]
        assert sorted(x["turn_index"] for x in mine) == [0, 0, 2]
        assert all(0.0 <= x["env_reward"] <= 1.0 and x["source"] == "persona" for x in mine)
        # The catalog joins them onto the pairs: each group member its own check, turn 1 the outcome.
        for p in by_session[r.session_id]:
            own = {x["env_reward"] for x in mine if x["turn_index"] == p.turn_index
                   and x["response_text"] == p.response_text}
            expected = own or {x["env_reward"] for x in mine if x["turn_index"] == 2}
            assert len(expected) == 1 and p.env_reward == expected.pop()
    terminal = [x for x in rows if x["source"] == "terminal" and x["session_id"] in ours]
    assert len(terminal) == 2 and all(x["env_reward"] == 0.0 for x in terminal)
    totals = Totals()
    totals.add(results)
    assert {row["environment"]: row["episodes"] for row in totals.rows()} == {"persona": 2, "terminal": 2}


@pytest.mark.slow
def test_collect_environment_flow_collects_and_shows_progress(make_config, prefect_api):
    # The gateway starts first: uvicorn reconfigures logging when it starts, which deadlocks
    # against a Prefect flow logging in another thread of the same process.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.collect_environment import collect_environment

    cfg = make_config(envs={"environments": ["persona"], "max_turns": 2, "episodes_per_round": 2,
                            "health_poll_s": 0.3, "max_tokens": 8}, serving={"threads": 1})
    with running_gateway(cfg):
        rows = collect_environment(str(cfg.source_file), rounds=1)
    [row] = rows
    assert row["environment"] == "persona" and row["episodes"] == 2 and row["failed"] == 0
    assert row["turns"] == 4 and row["next_states"] == 2 and 0.0 <= row["mean_outcome"] <= 1.0
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["environment-progress"])))
    tables = [json.loads(a.data) if isinstance(a.data, str) else a.data for a in arts]
    assert rows in tables  # progress shown in Prefect


@pytest.mark.parametrize("text, line, message", [
    ("personas:\n  - name: a\n    preferences:\n      - max_words: 3\n      - shouting: true\nprompts: [x]\n", 5,
     "unknown preference `shouting`"),
    ("personas:\n  - preferences: []\nprompts: [x]\n", 2, "missing `name`"),
    ("personas:\n  - name: a\n    preferences: [{max_words: 3}]\n", 1, "missing `prompts`"),
    ("personas: [\n  {name: a\n", 3, "not valid YAML"),
    ("personas:\n  - name: a\n    preferences: [{max_words: 3}]\n    prompts: hello\nprompts: [x]\n", 4,
     "`prompts` must be a non-empty list"),
])
def test_a_malformed_personas_file_is_one_line_naming_file_and_line(tmp_path, text, line, message):
    path = tmp_path / "personas.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_personas(path)
    assert str(err.value).startswith(f"{path}:{line}: ") and message in str(err.value)
    assert "\n" not in str(err.value)
