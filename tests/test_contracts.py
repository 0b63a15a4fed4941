"""The Parquet contracts between stages (clawflow/contracts/) and the data-directory layout
(clawflow/home.py): each record survives its own writer and reader, the file formats stay what
existing data was written with, contracts stay on the ground floor, and no stage spells a
data-directory name itself."""

from __future__ import annotations

import ast
import json
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from clawflow.contracts import env_reward, judgment, sample, turn
from clawflow.contracts import (
    EnvReward, Judged, JudgmentRow, Pair, Sample, read_env_rewards, read_judgments, read_samples, write_env_rewards,
    write_judgments, write_samples,
)
from clawflow.feedback import training_samples
from clawflow.home import Home
from clawflow.config import ServingConfig
from clawflow.contracts.turn import TurnRecord
from clawflow.store.storage import Storage

ROOT = Path(__file__).resolve().parents[1]

# The formats existing files were written with: a change here breaks reading old data.
FORMATS = {
    sample.SCHEMA: "turn_id:string prompt_token_ids:list<item: int32> response_token_ids:list<item: int32> "
                   "response_logprobs:list<item: float> reward:float hint:string messages:string tools:string "
                   "group_id:string policy_version:int64",
    judgment.SCHEMA: "turn_id:string session_id:string judge:string judge_version:string prompt_version:string "
                     "score:int8 votes:list<item: int8> rationale:string hint:string "
                     "created_at:timestamp[us, tz=UTC]",
    env_reward.SCHEMA: "session_id:string turn_index:int32 response_text:string env_reward:double source:string "
                       "created_at:timestamp[us, tz=UTC]",
    # schema v3; a new version adds columns (and an upgrade of older shards) in clawflow/contracts/turn.py
    turn.ARROW_SCHEMA: "turn_id:string session_id:string turn_index:int32 turn_type:string source:string "
                       "group_id:string created_at:timestamp[us, tz=UTC] policy_version:int64 messages:string "
                       "tools:string prompt_token_ids:list<item: int32> response_token_ids:list<item: int32> "
                       "response_logprobs:list<item: float> response_text:string tool_calls:string "
                       "finish_reason:string new_messages:string session_done:bool env_reward:double "
                       "prompt_tokens:int32 response_tokens:int32 user:string adapter_version:int64",
}


@pytest.mark.parametrize("schema", list(FORMATS), ids=["sample", "judgment", "env_reward", "turn"])
def test_file_formats_unchanged(schema):
    assert " ".join(f"{f.name}:{f.type}" for f in schema) == FORMATS[schema]


def test_sample_round_trip(tmp_path):
    records = [Sample([1, 2], [3, 4], [-0.5, -0.25], 1.0, hint="be brief", messages=[{"role": "user", "content": "hi"}],
                      tools=[{"type": "function", "function": {"name": "f"}}], group_id="g", policy_version=3,
                      turn_id="t1"),
               Sample([5], [6], [-1.0], -1.0)]
    path = write_samples(records, tmp_path / "runs" / "r1" / "samples.parquet")
    assert pq.read_schema(path).remove_metadata() == sample.SCHEMA
    assert read_samples(path) == records
    # rows already in the file's form (JSON text) read back the same
    rows = [r.to_row() for r in records]
    assert read_samples(write_samples(rows, tmp_path / "rows.parquet")) == records


def test_judgment_round_trip(tmp_path):
    storage = Storage(tmp_path)
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    rows = [JudgmentRow("t1", "s1", "llm", "1", "p1", 1, [1, None, 1], "good", None, at),
            JudgmentRow("t2", None, "llm", "1", None, -1, [], None, "say less", at)]
    path = write_judgments(storage, rows)
    assert Path(path).parent == Home(tmp_path).judgments
    assert pq.read_schema(path).remove_metadata() == judgment.SCHEMA
    assert read_judgments(storage) == rows
    assert judgment.judgment_files(storage) == [path]
    stamped = write_judgments(storage, [{**judgment_dict(rows[0]), "created_at": None, "extra": "ignored"}])
    assert stamped and read_judgments(storage)[-1].created_at is not None  # the writer stamps it
    assert write_judgments(storage, []) is None


def judgment_dict(row: JudgmentRow) -> dict:
    return {c: getattr(row, c) for c in judgment.COLUMNS}


def test_env_reward_round_trip(tmp_path):
    storage = Storage(tmp_path)
    at = datetime(2026, 1, 2, tzinfo=UTC)
    rows = [EnvReward("s1", 0, "ok", 1.0, "persona", at), EnvReward("s1", 2, None, None, None, at)]
    path = write_env_rewards(storage, rows)
    assert Path(path).parent == Home(tmp_path).env_rewards
    assert pq.read_schema(path).remove_metadata() == env_reward.SCHEMA
    assert read_env_rewards(storage) == rows
    assert env_reward.env_reward_files(storage) == [str(path)]
    write_env_rewards(storage, [{"session_id": "s2", "turn_index": 1, "response_text": "x", "env_reward": 0.5,
                                 "source": "terminal"}])
    assert {r.session_id for r in read_env_rewards(storage)} == {"s1", "s2"}
    assert all(r.created_at is not None for r in read_env_rewards(storage))
    assert write_env_rewards(storage, []) is None


def test_pair_from_a_shard_row_then_judged_then_a_sample(tmp_path):
    row = TurnRecord(session_id="s", turn_index=0, policy_version=2, messages=[{"role": "user", "content": "hi"}],
                     prompt_token_ids=[1, 2], response_token_ids=[3], response_logprobs=[-0.5], response_text="yo",
                     finish_reason="stop", new_messages=[]).to_row()
    pair = Pair.from_row({**row, "next_state": '[{"role": "user", "content": "shorter"}]', "next_role": "user"})
    assert (pair.turn_id, pair.prompt_tokens, pair.policy_version) == (row["turn_id"], 2, 2)
    assert not hasattr(pair, "finish_reason")  # columns the later stages do not read stay behind
    j = Judged.of(JudgmentRow(pair.turn_id, "s", "rules", "1", None, -1, [-1]), reward=-1.0, reused=False)
    write_judgments(Storage(tmp_path), [j])  # a Judged is stored as its row, the flow's extras left out
    [stored] = read_judgments(Storage(tmp_path))
    assert type(stored) is JudgmentRow and judgment_dict(stored) | {"created_at": None} == judgment_dict(j)
    [s] = training_samples([pair], [j])
    assert (s.turn_id, s.reward, s.messages, s.policy_version) == (pair.turn_id, -1.0, json.loads(row["messages"]), 2)


def test_turn_user_round_trips_and_older_rows_are_the_default_user():
    rec = TurnRecord(session_id="s", turn_index=0, policy_version=2, messages=[{"role": "user", "content": "hi"}],
                     prompt_token_ids=[1, 2], response_token_ids=[3], response_logprobs=[-0.5], response_text="yo",
                     finish_reason="stop", new_messages=[], user="alice")
    assert turn.SCHEMA_VERSION == 4 and turn.ADDED[3].keys() == {"user"} and turn.ADDED[4].keys() == {"adapter_version"}
    assert TurnRecord.from_row(json.loads(rec.to_json())) == rec  # the WAL line
    assert turn.rows_to_table([rec.to_row()])["user"].to_pylist() == ["alice"]  # the shard row
    assert Pair.from_row({**rec.to_row(), "next_state": None}).user == "alice"

    older = json.loads(rec.to_json())  # a WAL line written before v3 has no `user`
    del older["user"]
    assert TurnRecord.from_row(older).user == turn.DEFAULT_USER == "default"
    assert turn.upgrade_row({"prompt_token_ids": [1]})["user"] == "default"
    served = TurnRecord.from_row({**json.loads(rec.to_json()), "adapter_version": 7})  # v4: the user's adapter
    assert TurnRecord.from_row(json.loads(served.to_json())).adapter_version == 7 and rec.adapter_version is None
    assert turn.rows_to_table([served.to_row()])["adapter_version"].to_pylist() == [7]
    assert TurnRecord.from_row(older).adapter_version is None  # before v4: the shared policy decoded it
    assert Pair(turn_id="t", session_id="s", turn_index=0, messages="[]", prompt_token_ids=[], response_token_ids=[],
                response_logprobs=[], response_text="", next_state=None).user == "default"
    assert ServingConfig().user == turn.DEFAULT_USER  # the config's default names the same user


@pytest.mark.parametrize("bad", ["", "a b", "x" * 65, "Zoë", "../etc", "a\n"])
def test_serving_user_is_a_short_plain_name(bad):
    assert ServingConfig(user="Team.bot_7-x").user == "Team.bot_7-x"
    with pytest.raises(ValidationError, match="user"):
        ServingConfig(user=bad)


def test_sample_files_lists_each_runs_batch(tmp_path):
    home = Home(tmp_path)
    for run in ("a", "b"):
        write_samples([Sample([1], [2], [-0.1], 1.0)], home.samples(run))
    write_samples([Sample([1], [2], [-0.1], 1.0)], home.runs / "a" / "nested" / "samples.parquet")
    assert sample.sample_files(Storage(tmp_path)) == [home.samples("a"), home.samples("b")]


def test_home_names_are_distinct_and_paths_local():
    names = Home.names()
    assert len(set(names.values())) == len(names)
    assert Home.samples_rel("r") == "runs/r/samples.parquet"
    assert Home(Path("/h")).outbox == Path("/h/outbox/shards") and Home("/h").shards == Path("/h/shards")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
    return out


def test_contracts_stay_on_the_ground_floor():
    files = [ROOT / "clawflow" / "home.py", *sorted((ROOT / "clawflow" / "contracts").glob("*.py"))]
    for path in files:
        for name in _imports(path):
            if name.split(".")[0] in ("clawflow", "tasks", "flows"):
                assert name == "clawflow.home" or name.startswith("clawflow.contracts"), f"{path.name} imports {name}"


# Files that still spell a name, each with the reason; shrink this list, never grow it.
KNOWN: dict[str, str] = {}  # file -> why it may still spell a name itself
# Calls that take a name relative to a root (Storage) or build a path from one.
PATH_CALLS = {"join", "joinpath", "list", "put_bytes", "write_parquet", "move", "relative_to", "glob", "rglob"}
# Roots that are not a data directory: the repository (configs/eval), the venv's bin (prefect).
OTHER_ROOTS = {"REPO_ROOT", "BIN"}


def _root_name(node) -> str | None:
    while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        node = node.left
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _strays(path: Path, names: set[str]) -> list[str]:
    """Data-directory names spelled as path parts: `x / "runs"`, `storage.list("judgments")`,
    `"quarantine/…"`, `f"runs/{id}/…"` (docstrings, dict keys and SQL parameters are not paths)."""
    tree = ast.parse(path.read_text())
    found = []

    def named(node) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names

    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and (named(node.left) or named(node.right)):
            if _root_name(node) in OTHER_ROOTS:
                continue
            found.append(f"{node.lineno}: / {(node.right if named(node.right) else node.left).value!r}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in PATH_CALLS:
            found += [f"{node.lineno}: .{node.func.attr}({a.value!r})" for a in node.args if named(a)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" not in node.value:
            if any(node.value.startswith(f"{n}/") for n in names):
                found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_no_data_directory_literal_outside_home():
    names = set(Home.names().values())
    strays = {}
    for top in ("clawflow", "flows", "tasks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "clawflow/home.py" or rel in KNOWN:
                continue
            if found := _strays(path, names):
                strays[rel] = found
    assert not strays, f"spell these through clawflow.home.Home: {strays}"
    for rel in KNOWN:  # an exemption that is no longer needed goes
        assert _strays(ROOT / rel, names), f"{rel} no longer needs its exemption in KNOWN"
