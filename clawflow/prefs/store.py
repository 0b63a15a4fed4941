"""Standing preferences on disk: one small Parquet file under the storage root
(`preferences/preferences.parquet`, beside shards/ and judgments/, local or an object store),
read-modify-written under the store lock, so a training run and `clawflow prefs forget` never lose
each other's change. DuckDB reads it as the view `preferences` (`query`)."""

from __future__ import annotations

import logging
from pathlib import Path

from clawflow.home import Home
from clawflow.prefs import update as U
from clawflow.prefs.record import Preference, from_table, ranked, to_table
from clawflow.store.locks import store_lock
from clawflow.store.storage import Storage

log = logging.getLogger(__name__)


class PreferenceStore:
    def __init__(self, storage: Storage, home: Path):
        self.storage, self.home = storage, Path(home)
        self.path = storage.join(Home.PREFERENCES, Home.PREFERENCES_FILE)

    @classmethod
    def for_config(cls, cfg) -> PreferenceStore:
        return cls(Storage.for_config(cfg), cfg.home)

    def load(self) -> list[Preference]:
        return from_table(self.storage.read_table(self.path)) if self.storage.exists(self.path) else []

    def _save(self, prefs: list[Preference]) -> None:
        self.storage.rewrite_parquet(to_table(prefs), self.path)

    def active(self, user: str) -> list[Preference]:
        """The user's active preferences, strongest first."""
        return ranked(self.load(), user)

    def add_hints(self, hints: list[U.NewHint]) -> list[str]:
        """Fold the hints of turns judged −1 into the preferences; one log line per hint."""
        if not hints:
            return []
        with store_lock(self.home):
            prefs, lines = U.fold(self.load(), hints, _similarity())
            self._save(prefs)
        for line in lines:
            log.info("preferences: %s", line)
        return lines

    def set_strengths(self, user: str, strengths: dict[str, float]) -> int:
        if not strengths:
            return 0
        with store_lock(self.home):
            prefs = self.load()
            n = U.set_strengths(prefs, user, strengths)
            self._save(prefs)
        return n

    def forget(self, pref_id: str) -> Preference | None:
        """Drop one preference (any status); the dropped record, or None when there is no such id."""
        with store_lock(self.home):
            prefs = self.load()
            gone = next((p for p in prefs if p.pref_id == pref_id), None)
            if gone is not None:
                self._save([p for p in prefs if p.pref_id != pref_id])
        return gone

    def forget_session(self, session_id: str) -> list[str]:
        """Remove what `session_id` said; ids of the preferences that came only from it (dropped)."""
        if not self.storage.exists(self.path):
            return []
        with store_lock(self.home):
            prefs, dropped = U.forget_session(self.load(), session_id)
            self._save(prefs)
        return dropped

    def forget_user(self, user: str) -> list[str]:
        """Drop every preference of `user` (any status); their ids."""
        if not self.storage.exists(self.path):
            return []
        with store_lock(self.home):
            prefs = self.load()
            dropped = [p.pref_id for p in prefs if p.user == user]
            if dropped:
                self._save([p for p in prefs if p.user != user])
        return dropped

    def query(self, con, sql: str) -> list[tuple]:
        """`sql` over the view `preferences` on a DuckDB connection (e.g. the catalog's)."""
        if not self.storage.exists(self.path):
            return []
        con.execute(f"CREATE OR REPLACE TEMP VIEW preferences AS SELECT * FROM read_parquet('{self.path}')").fetchall()
        return con.execute(sql).fetchall()


def _similarity():
    """MiniLM cosine of two texts, loaded on first use (only free-form preferences need it)."""
    cache: dict = {}

    def cosine(a: str, b: str) -> float:
        if "m" not in cache:
            from clawflow.judge.minilm import MiniLM

            cache["m"] = MiniLM(threads=1)
        e = cache["m"].embed([a, b])  # unit vectors (MiniLM normalizes), as helpfulness.relevance uses them
        return float((e[0] * e[1]).sum())

    return cosine
