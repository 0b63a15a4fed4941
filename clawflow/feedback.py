"""From catalog pairs to a training batch: judge each turn by its next state, keep the signal.

Pure library logic; the `train-on-new-feedback` flow calls it through thin tasks.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from clawflow.judge import Judge, JudgeInput, judge_many

SAMPLE_SCHEMA = pa.schema([
    ("turn_id", pa.string()),
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("response_token_ids", pa.list_(pa.int32())),
    ("response_logprobs", pa.list_(pa.float32())),
    ("reward", pa.float32()),
    ("hint", pa.string()),
])


def judge_input(pair: dict[str, Any]) -> JudgeInput:
    turn = {"role": "assistant", "content": pair["response_text"]}
    if pair.get("tool_calls"):
        turn["tool_calls"] = json.loads(pair["tool_calls"])
    return JudgeInput(
        context=json.loads(pair["messages"]),
        turn=turn,
        next_state=json.loads(pair["next_state"] or "[]"),
        next_role=pair.get("next_role") or "user",
    )


def judge_pairs(judge: Judge, pairs: list[dict[str, Any]], concurrency: int = 8) -> list[dict[str, Any]]:
    """One judgment dict per pair, in order (turn_id, score, votes, rationale, hint, judge)."""
    judgments = asyncio.run(judge_many(judge, [judge_input(p) for p in pairs], concurrency))
    return [{"turn_id": p["turn_id"], **asdict(j)} for p, j in zip(pairs, judgments)]


def training_samples(pairs: list[dict[str, Any]], judgments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turns with a non-zero score become samples with reward = score (binary RL)."""
    by_id = {j["turn_id"]: j for j in judgments}
    return [
        {
            "turn_id": p["turn_id"],
            "prompt_token_ids": list(p["prompt_token_ids"]),
            "response_token_ids": list(p["response_token_ids"]),
            "response_logprobs": list(p["response_logprobs"]),
            "reward": float(by_id[p["turn_id"]]["score"]),
            "hint": by_id[p["turn_id"]].get("hint"),
        }
        for p in pairs
        if by_id[p["turn_id"]]["score"] != 0 and len(p["response_token_ids"]) > 0
    ]


def write_samples(samples: list[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(samples, schema=SAMPLE_SCHEMA), path)
    return path
