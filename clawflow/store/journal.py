"""Crash-safe replacement of several shards by others (compaction), rolled forward after a crash.

Replacing N files by M cannot be one rename. The new shards are first written as fsynced temp
files; then a journal naming outputs and inputs is made durable (the commit point); then the temp
files are renamed into place and the inputs deleted; then the journal is removed. A crash before
the journal exists leaves only temp files (deleted at recovery); a crash after it is finished by
`recover`, so no turn is lost and none stays duplicated.

On an object-store root the same protocol runs on object keys (`replace_objects`): the merged
shard is first put under `staging/` (which no reader lists), the journal in the orchestrator's
local home is the commit point, then the staged object is copied to its final key under
`shards/` (a copy keeps its checksum) and the inputs and the staged object are deleted.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from contextlib import suppress
from pathlib import Path

from clawflow.home import Home
from clawflow.store.shards import TMP_SUFFIX, remove_stale_temps
from clawflow.store.wal import fsync_dir

log = logging.getLogger("clawflow.store.journal")

DIR = Home.JOURNAL


def replace_shards(home: Path, outputs: list[Path], inputs: list[Path]) -> None:
    """Swap `inputs` for `outputs`, whose contents are already written at `<output>.tmp` (fsynced)."""
    home = Path(home)
    entry = {"outputs": [str(Path(p).relative_to(home)) for p in outputs],
             "inputs": [str(Path(p).relative_to(home)) for p in inputs]}
    _finish(home, _commit(home, entry), entry)


def replace_objects(home: Path, storage, staged: str, final: str, inputs: list[str]) -> None:
    """Swap the shard objects `inputs` for `final`, whose contents are already at `staged`."""
    entry = {"objects": True, "staged": staged, "final": final, "inputs": inputs}
    _finish_objects(storage, _commit(Path(home), entry), entry)


def _commit(home: Path, entry: dict) -> Path:
    jdir = home / DIR
    jdir.mkdir(parents=True, exist_ok=True)
    journal = jdir / f"{uuid.uuid4().hex}.json"
    tmp = journal.with_name(journal.name + TMP_SUFFIX)
    with open(tmp, "w") as f:
        json.dump(entry, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, journal)
    fsync_dir(jdir)  # committed: from here on, recovery finishes the swap
    return journal


def _finish_objects(storage, journal: Path, entry: dict) -> None:
    if not storage.exists(entry["final"]):
        if not storage.exists(entry["staged"]):
            log.error("journal %s: staged %s is missing; keeping its inputs", journal.name, entry["staged"])
            journal.unlink()
            return
        storage.fs.copy(entry["staged"], entry["final"])  # server-side; the checksum metadata comes along
    for url in [*entry["inputs"], entry["staged"]]:
        with suppress(FileNotFoundError):
            storage.delete(url)
    journal.unlink()
    fsync_dir(journal.parent)


def _finish(home: Path, journal: Path, entry: dict) -> None:
    dirs = set()
    for rel in entry["outputs"]:
        final = home / rel
        staged = final.with_name(final.name + TMP_SUFFIX)
        if staged.exists():
            os.replace(staged, final)
        elif not final.exists():
            log.error("journal %s: output %s is missing; keeping its inputs", journal.name, rel)
            journal.unlink()
            return
        dirs.add(final.parent)
    for rel in entry["inputs"]:
        (home / rel).unlink(missing_ok=True)
        dirs.add((home / rel).parent)
    for d in dirs:
        if d.exists():
            fsync_dir(d)
    journal.unlink()
    fsync_dir(journal.parent)


def recover(home: Path, storage=None) -> int:
    """Finish swaps a crash interrupted, then drop orphan temp files (call under the store lock).
    `storage`: the object-store root, to finish object swaps (without it they wait)."""
    home = Path(home)
    jdir = home / DIR
    done = 0
    remote = storage is not None and storage.remote
    pending = set()
    for journal in sorted(jdir.glob("*.json")) if jdir.is_dir() else []:
        try:
            entry = json.loads(journal.read_text())
        except ValueError:
            journal.unlink()  # torn before its rename: never committed
            continue
        if entry.get("objects") and not remote:
            pending.add(entry["staged"])
            continue  # the catalog, which has the store, finishes it
        log.warning("finishing an interrupted shard replacement (%s)", journal.name)
        if entry.get("objects"):
            _finish_objects(storage, journal, entry)
        else:
            _finish(home, journal, entry)
        done += 1
    for orphan in storage.list(Home.STAGING) if remote else []:  # staged, never committed
        if str(orphan.path) not in pending:
            storage.delete(orphan.path)
    for tmp in jdir.glob(f"*{TMP_SUFFIX}") if jdir.is_dir() else []:
        tmp.unlink()
    remove_stale_temps(Home(home).shards)
    return done
