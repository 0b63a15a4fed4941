"""What the contracts need of a storage root, and a typo-proof view of a record's columns.

A Protocol, not an import of clawflow.store.storage: contracts sit below the store, and a
`Storage` (local directory or object store) satisfies it as it is.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Protocol

import pyarrow as pa
import pyarrow.parquet as pq


class Listed(Protocol):
    path: Path | str
    rel: str


class Root(Protocol):
    """A storage root: names relative to it in, paths or URLs out (clawflow/store/storage.py)."""

    def list(self, folder: str, suffix: str = ".parquet") -> list[Listed]: ...

    def read_bytes(self, path: Path | str) -> bytes: ...

    def write_parquet(self, table: pa.Table, rel: str) -> Path | str: ...


def columns(record: type) -> SimpleNamespace:
    """`columns(R).name == "name"` for each field of dataclass `R`: SQL and Arrow code spell a
    column through it, so a renamed field fails at import, not at query time."""
    return SimpleNamespace(**{f.name: f.name for f in dataclasses.fields(record)})


def check_schema(record: type, schema: pa.Schema) -> None:
    """The record and its Arrow schema name the same columns, in the same order."""
    names = [f.name for f in dataclasses.fields(record)]
    if names != schema.names:
        raise TypeError(f"{record.__name__} fields {names} != its Arrow schema {schema.names}")


def read_rows(root: Root, folder: str, schema: pa.Schema) -> list[dict]:
    """The rows of every Parquet file under `folder` of `root` (path order), read with `schema`;
    on an object store each file's checksum is verified (Storage.read_bytes)."""
    tables = [pq.read_table(pa.BufferReader(root.read_bytes(e.path)), schema=schema) for e in root.list(folder)]
    return [row for t in tables for row in t.to_pylist()]
