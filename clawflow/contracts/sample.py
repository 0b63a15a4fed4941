"""The training sample: one judged assistant turn, as the orchestrator hands it to the trainer.

The orchestrator writes a run's samples to `runs/<run_id>/samples.parquet` (feedback.py; a copy
beside the shards on an object store), the trainer reads them back (train/batch.py): one schema,
one record, one reader, one writer for both sides. The record holds the token ids and logprobs
exactly as the engine sampled them, the reward, and (for OPD) a hindsight hint plus the request's
messages so the trainer can build the hint-augmented teacher prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from clawflow.contracts._parquet import Root, columns
from clawflow.home import Home

SCHEMA = pa.schema([
    ("turn_id", pa.string()),
    ("prompt_token_ids", pa.list_(pa.int32())),
    ("response_token_ids", pa.list_(pa.int32())),
    ("response_logprobs", pa.list_(pa.float32())),
    ("reward", pa.float32()),
    ("hint", pa.string()),
    ("messages", pa.string()),  # JSON: the request, for the trainer's hint-augmented OPD teacher prompt
    ("tools", pa.string()),  # JSON or null
    ("group_id", pa.string()),  # samples of one prompt (n > 1, environments): GRPO normalization
    ("policy_version", pa.int64()),  # the version that sampled the turn: staleness
])
# A file without an optional column still trains (older batches, hand-made ones): defaults below.
REQUIRED = ("prompt_token_ids", "response_token_ids", "response_logprobs", "reward")
OPTIONAL = tuple(n for n in SCHEMA.names if n not in REQUIRED)
JSON_COLUMNS = ("messages", "tools")


@dataclass(slots=True)
class Sample:
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    reward: float
    hint: str | None = None
    messages: list[dict] | None = None  # the request, for the hint-augmented teacher prompt
    tools: list[dict] | None = None
    group_id: str | None = None
    policy_version: int = 0
    turn_id: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("sample has an empty prompt (the first response token needs one)")
        if len(self.response_logprobs) != len(self.response_token_ids):
            raise ValueError(
                f"sample has {len(self.response_token_ids)} response tokens but "
                f"{len(self.response_logprobs)} logprobs"
            )

    def to_row(self) -> dict[str, Any]:
        """The file's row: messages and tools as JSON text."""
        row = {name: getattr(self, name) for name in SCHEMA.names}
        for name in JSON_COLUMNS:
            row[name] = None if row[name] is None else json.dumps(row[name])
        return row


COL = columns(Sample)
if set(SCHEMA.names) != set(vars(COL)):  # the record's order differs (defaults last); the names may not
    raise TypeError(f"Sample fields {sorted(vars(COL))} != its Arrow schema {sorted(SCHEMA.names)}")


def _json(value):
    return json.loads(value) if isinstance(value, str) and value else None


def write_samples(samples: Iterable[Sample | Mapping[str, Any]], path: Path) -> Path:
    """A batch file at `path` (a local path): Sample records, or rows already in the file's form
    (`Sample.to_row()`: JSON text for messages and tools)."""
    rows = [s.to_row() if isinstance(s, Sample) else s for s in samples]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)
    return path


def read_samples(parquet_path: str | Path) -> list[Sample]:
    """Read the training columns of a Parquet file (missing optional columns get defaults)."""
    file = pq.ParquetFile(parquet_path)  # one file: read_table would import pyarrow.dataset (0.5 s a trainer)
    names = set(file.schema_arrow.names)
    missing = [c for c in REQUIRED if c not in names]
    if missing:
        raise ValueError(f"{parquet_path} lacks columns {missing}")
    table = file.read(columns=list(REQUIRED) + [c for c in OPTIONAL if c in names])
    samples = []
    for row in table.to_pylist():
        samples.append(Sample(
            prompt_token_ids=list(row["prompt_token_ids"]),
            response_token_ids=list(row["response_token_ids"]),
            response_logprobs=[float(x) for x in row["response_logprobs"]],
            reward=float(row["reward"] or 0.0),
            hint=(row.get("hint") or "").strip() or None,
            messages=_json(row.get("messages")),
            tools=_json(row.get("tools")),
            group_id=row.get("group_id") or None,
            policy_version=int(row.get("policy_version") or 0),
            turn_id=row.get("turn_id"),
        ))
    return samples


def sample_files(root: Root) -> list[Path | str]:
    """Every run's samples file under a storage root (`runs/<run_id>/samples.parquet`)."""
    return [e.path for e in root.list(Home.RUNS)
            if e.rel.count("/") == 1 and e.rel.endswith(f"/{Home.SAMPLES_FILE}")]
