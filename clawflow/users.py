"""Users: a user is the owner of an API key, and every turn that key sends is recorded as theirs.

Three places name a key's owner: `serving.api_key` is `serving.user`'s (the default user);
`serving.users` maps more names to the SHA-256 of their keys (for people who keep users in config);
`clawflow users add` writes $CLAWFLOW_HOME/users/users.json. Keys themselves are never stored, only
their SHA-256 (a key is a random token, so a plain hash cannot be reversed by guessing).

Stdlib only (and clawflow.home), so the config and the CLI may import it cheaply.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from clawflow.home import Home

log = logging.getLogger("clawflow.users")

NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"  # a user name: also a config field's pattern
HASH_PATTERN = r"^[0-9a-f]{64}$"  # SHA-256, lowercase hex
# clawflow.contracts.turn.DEFAULT_USER (not imported: that module pulls in pyarrow): the owner of
# turns recorded before users existed, so a new user under that name would inherit them
LEGACY_USER = "default"


class UserError(ValueError):
    """A refused `users` change; the message is one line."""


UNKNOWN = "Incorrect or missing API key (send `Authorization: Bearer <key>`)."


class KeyRefused(Exception):
    """A Bearer key that names no active user; the message is the 401's."""


def new_key() -> str:
    return "cf-" + secrets.token_urlsafe(24)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_name(name: str) -> str:
    if not re.fullmatch(NAME_PATTERN, name):
        raise UserError(f"user name {name!r}: use 1-64 characters of A-Z a-z 0-9 _ . -")
    return name


@dataclass(frozen=True)
class User:
    name: str
    key_sha256: str
    created_at: str  # ISO 8601, UTC
    deleted_at: str | None = None  # set by `users remove`; their data stays until `clawflow forget`


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def parse(text: str) -> list[User]:
    """The users file's users; ValueError on anything malformed (the gateway then trusts none)."""
    raw = json.loads(text)
    users = [User(**u) for u in raw["users"]]
    for u in users:
        check_name(u.name)
        if not re.fullmatch(HASH_PATTERN, u.key_sha256):
            raise ValueError(f"user {u.name}: key_sha256 is not a SHA-256 hex digest")
    return users


class UserFile:
    """$CLAWFLOW_HOME/users/users.json: changed under a lock, replaced atomically (readers never
    see half a file, so the gateway reads it without the lock)."""

    def __init__(self, home: Path):
        self.path, self.lock_path = Home(home).users_file, Home(home).users_lock

    def load(self) -> list[User]:
        try:
            return parse(self.path.read_text())
        except FileNotFoundError:
            return []

    @contextmanager
    def _locked(self) -> Iterator[list[User]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if we die
            yield self.load()
        finally:
            os.close(fd)

    def _write(self, users: list[User]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump({"users": [asdict(u) for u in users]}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def add(self, name: str, taken: set[str] = frozenset()) -> str:
        """A new user; returns their key (the only time it exists outside the client). `taken`:
        names owned elsewhere (serving.user, serving.users)."""
        check_name(name)
        if name in taken:
            raise UserError(f"user {name!r} already exists (its key is set in the config): choose another name")
        if name == LEGACY_USER:
            raise UserError(f"{name!r} owns the turns recorded before users existed: choose another name")
        with self._locked() as users:
            if old := next((u for u in users if u.name == name), None):
                state = "was removed; their data keeps the name until forgotten" if old.deleted_at else "already exists"
                raise UserError(f"user {name!r} {state}: choose another name")
            key = new_key()
            self._write([*users, User(name, key_hash(key), _now())])
        return key

    def remove(self, name: str) -> User | None:
        """Mark `name` deleted (their key stops working); None when already removed."""
        with self._locked() as users:
            old = next((u for u in users if u.name == name), None)
            if old is None:
                raise UserError(f"no user {name!r} in {self.path} (see `clawflow users list`)")
            if old.deleted_at:
                return None
            gone = User(old.name, old.key_sha256, old.created_at, _now())
            self._write([gone if u is old else u for u in users])
        return gone


class KeyResolver:
    """Bearer key → the user it belongs to, for the gateway. Reads `cfg.serving` on every call and
    re-reads the users file when it changes, so neither `users add` nor `remove` needs a restart."""

    def __init__(self, cfg: Any):
        self.cfg, self.file = cfg, UserFile(cfg.home)
        self._cache: tuple[Any, list[User]] = (None, [])  # (file signature, users): swapped whole

    def _file_users(self) -> list[User]:
        try:
            st = os.stat(self.file.path)
            sig = (st.st_mtime_ns, st.st_ino, st.st_size)  # os.replace gives a new inode
        except FileNotFoundError:
            return []
        if sig != self._cache[0]:
            try:
                users = self.file.load()
            except (ValueError, TypeError, KeyError, OSError) as exc:  # fail closed: no file user gets in
                log.error("users file %s unreadable (%s); its keys are refused until it is fixed", self.file.path, exc)
                users = []
            self._cache = (sig, users)
        return self._cache[1]

    def resolve(self, key: str | None) -> str:
        """The key's user; KeyRefused for a missing, unknown or removed user's key."""
        s = self.cfg.serving
        if key is None:
            raise KeyRefused(UNKNOWN)
        if hmac.compare_digest(key.encode(), s.api_key.encode()):  # constant time
            return s.user
        digest = key_hash(key).encode()
        found = None  # every entry is compared, so the time taken does not tell which matched
        for name, h in s.users.items():
            if hmac.compare_digest(digest, h.encode()):
                found = (name, None)
        for u in self._file_users():
            if hmac.compare_digest(digest, u.key_sha256.encode()):
                found = (u.name, u.deleted_at)
        if found is None:
            raise KeyRefused(UNKNOWN)
        if found[1]:
            raise KeyRefused(f"This API key's user, {found[0]}, was removed; ask for a new key.")
        return found[0]
