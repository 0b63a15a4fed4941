"""Where shards, judgments and env rewards live: a local directory, or an object store.

`store.root` unset means `$CLAWFLOW_HOME`: every file is a plain local path, written as before
(temp name, fsync, rename), nothing new to install or start. `s3://bucket/prefix` (the `s3`
extra: s3fs; any S3-compatible server, e.g. MinIO, with `storage_options.endpoint_url`) puts
them where gateways on other hosts and the orchestrator all reach them. The WAL and the DuckDB
catalog never move: they are each host's own.

On an object store:
- An object is written with a conditional put (`If-None-Match: *`): it appears whole or not at
  all, and it never replaces an object someone else wrote. Its SHA-256 rides in the object's
  metadata, and `read_bytes` verifies it: a shard damaged or cut short in the store is refused
  (the catalog quarantines it), never trained on.
- Putting the same bytes again (a crash after the upload, before the local copy was deleted)
  finds the object with the same checksum: a success, not a duplicate. Other bytes under the
  same name mean two writers chose one name: ObjectExists, and the caller picks another name.
- The one writer that replaces objects is the orchestrator, for `forget` and retention
  (`rewrite_parquet`, `replace_bytes`): a PUT replaces an object whole, readers see either.
- DuckDB reads the objects through this same fsspec filesystem (`register_filesystem`), not its
  httpfs extension: DuckDB downloads extensions from its own site at run time, which hosts
  without that access (these machines) cannot, and one set of options then serves both readers.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import socket
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from clawflow.store.shards import write_parquet_atomic

SHA_KEY = "clawflow-sha256"  # user metadata of every object clawflow writes
REMOTE_SCHEMES = ("s3", "s3a")
# Fail fast on a store that is down (the sealer retries on its next pass) instead of botocore's
# long default backoff; the user's own `config_kwargs` win.
_S3_DEFAULTS = {"config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                                  "retries": {"max_attempts": 2, "mode": "standard"}}}


class StorageError(RuntimeError):
    """A storage root that cannot be used (unknown scheme, missing package)."""


class ObjectExists(FileExistsError):
    """Another writer's object already has this name (with other contents)."""


class ChecksumMismatch(ValueError):
    """An object whose bytes do not match the checksum it was written with."""


@dataclass(frozen=True)
class Entry:
    path: Path | str  # a local Path, or the object's URL
    rel: str  # relative to the listed folder, with `/`
    size: int
    mtime: float


class Storage:
    """One storage root; `join`, `list`, `read_bytes`, `put_bytes`, `write_parquet`, `move`."""

    def __init__(self, root: str | os.PathLike, options: dict[str, Any] | None = None):
        text = str(root)
        scheme = text.split("://", 1)[0] if "://" in text else None
        self.remote = scheme not in (None, "file")
        if not self.remote:
            self.root: Path | str = Path(text.removeprefix("file://")).expanduser().resolve()
            self.fs = None
            return
        if scheme not in REMOTE_SCHEMES:
            raise StorageError(f"store.root {text!r}: only local paths and s3:// URLs are supported")
        try:
            import fsspec

            self.fs = fsspec.filesystem(scheme, **{**_S3_DEFAULTS, **(options or {})})
        except ImportError as exc:
            raise StorageError(f"store.root {text!r} needs s3fs: pip install 'clawflow[s3]' ({exc})") from exc
        self.root = text.rstrip("/")

    @classmethod
    def from_store(cls, home: Path, store) -> "Storage":
        """The root of a StoreConfig (`$CLAWFLOW_HOME` when it names none)."""
        return cls(store.root or home, store.storage_options)

    @classmethod
    def for_config(cls, cfg) -> "Storage":
        return cls.from_store(cfg.home, cfg.store)

    def __repr__(self) -> str:
        return f"Storage({str(self.root)!r})"

    def join(self, *parts: str) -> Path | str:
        if self.remote:
            return "/".join([str(self.root), *(p.strip("/") for p in parts)])
        return Path(self.root).joinpath(*parts)

    # -- reading ------------------------------------------------------------------------------
    def list(self, folder: str, suffix: str = ".parquet") -> list[Entry]:
        """Files under `folder` (recursively) ending in `suffix`, sorted by path."""
        base = self.join(folder)
        if not self.remote:
            out = []
            for p in sorted(Path(base).rglob(f"*{suffix}")) if Path(base).is_dir() else []:
                with suppress(FileNotFoundError):  # removed meanwhile (compaction)
                    st = p.stat()
                    out.append(Entry(p, p.relative_to(base).as_posix(), st.st_size, st.st_mtime))
            return out
        stripped = self.fs._strip_protocol(base)
        self.fs.invalidate_cache(stripped)  # listings are cached per instance: other hosts add objects
        try:
            found = self.fs.find(stripped, detail=True)
        except FileNotFoundError:
            return []
        out = []
        for name, info in sorted(found.items()):
            if info.get("type", "file") == "file" and name.endswith(suffix):
                modified = info.get("LastModified")
                mtime = modified.timestamp() if isinstance(modified, datetime) else 0.0
                out.append(Entry(f"{self.scheme}://{name}", name[len(stripped) + 1:], int(info["size"]), mtime))
        return out

    @property
    def scheme(self) -> str:
        return str(self.root).split("://", 1)[0]

    def read_bytes(self, path: Path | str) -> bytes:
        """The whole file; on an object store, verified against its checksum (ChecksumMismatch)."""
        if not self.remote:
            return Path(path).read_bytes()
        data = self.fs.cat_file(str(path))
        want = self._checksum(str(path))
        if want is None:
            raise ChecksumMismatch(f"{path} carries no {SHA_KEY} (not written by clawflow); refused")
        if hashlib.sha256(data).hexdigest() != want:
            raise ChecksumMismatch(f"{path}: {len(data)} bytes do not match the checksum they were written with")
        return data

    def _checksum(self, url: str) -> str | None:
        meta = self.fs.metadata(url, refresh=True)
        return {k.lower(): v for k, v in (meta or {}).items()}.get(SHA_KEY)

    def attach(self, con) -> None:
        """Let a DuckDB connection read this root's URLs (`read_parquet('s3://…')`)."""
        if not self.remote:
            return
        try:
            con.register_filesystem(self.fs)
        except duckdb.InvalidInputException as exc:  # connections to one open database share its
            if "already been registered" not in str(exc):  # filesystems: another one registered it
                raise

    # -- writing ------------------------------------------------------------------------------
    def put_bytes(self, data: bytes, rel: str) -> str:
        """Create the object `rel` with `data` (a conditional put with its checksum); its URL."""
        if not self.remote:
            raise StorageError("put_bytes is for object stores; local roots write through write_parquet")
        url, sha = str(self.join(rel)), hashlib.sha256(data).hexdigest()
        try:
            self.fs.pipe_file(url, data, mode="create", Metadata={SHA_KEY: sha})
        except FileExistsError:
            if self._checksum(url) != sha:
                raise ObjectExists(f"{url} already exists with other contents") from None
        return url  # new, or the same bytes put again

    def write_parquet(self, table: pa.Table, rel: str) -> Path | str:
        """A small Parquet file (judgments, env rewards) at `rel`, whole or not at all."""
        if not self.remote:
            path = Path(self.join(rel))
            write_parquet_atomic(table, path)
            return path
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd", write_page_checksum=True)
        return self.put_bytes(buf.getvalue(), rel)

    def read_table(self, path: Path | str) -> pa.Table:
        """A Parquet file of this root (an object's checksum verified)."""
        return pq.read_table(path) if not self.remote else pq.read_table(pa.BufferReader(self.read_bytes(path)))

    def rewrite_parquet(self, table: pa.Table, path: Path | str) -> None:
        """Replace an existing file with `table` (forget, retention: the orchestrator removing rows).
        Locally a temp file and a rename; on an object store a plain put, which replaces an object
        whole (readers see the old or the new one), with the new checksum."""
        if not self.remote:
            write_parquet_atomic(table, Path(path))
            return
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd", write_page_checksum=True)
        self.replace_bytes(buf.getvalue(), str(path))

    def replace_bytes(self, data: bytes, url: str) -> None:
        self.fs.pipe_file(url, data, Metadata={SHA_KEY: hashlib.sha256(data).hexdigest()})

    def exists(self, path: Path | str) -> bool:
        if not self.remote:
            return Path(path).exists()
        self.fs.invalidate_cache(str(path))
        return self.fs.exists(str(path))

    def delete(self, path: Path | str) -> None:
        if self.remote:
            self.fs.rm_file(str(path))
        else:
            Path(path).unlink(missing_ok=True)

    def mtime(self, path: Path | str) -> float:
        """As `list` reports it (an object's LastModified)."""
        if not self.remote:
            return Path(path).stat().st_mtime
        folder, name = str(path).rsplit("/", 1)
        rel = folder.removeprefix(f"{self.root}/")
        match = [e for e in self.list(rel, suffix=name) if str(e.path) == str(path)]  # listed: same precision
        if not match:
            raise FileNotFoundError(path)
        return match[0].mtime

    def move(self, src: Path | str, rel: str) -> Path | str:
        """Move a file of this root to `rel` (quarantine); its new path."""
        dst = self.join(rel)
        if self.remote:
            self.fs.mv(str(src), str(dst))  # copy (metadata kept) + delete
        else:
            Path(dst).parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
        return dst


def replica_id(store) -> str | None:
    """The id this gateway puts in its segment (and so shard) names: `store.replica_id`, else
    $CLAWFLOW_REPLICA_ID, else the host name when the root is shared (set), else none (laptop)."""
    chosen = store.replica_id or os.environ.get("CLAWFLOW_REPLICA_ID")
    if not chosen and store.root:
        chosen = socket.gethostname()
    return re.sub(r"[^A-Za-z0-9_.-]", "_", chosen)[:64] if chosen else None
