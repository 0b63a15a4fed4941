"""Rewrites and preference strengths kept across runs.

What the hinted policy writes for a prompt depends only on the weights that write it, the prompt
pair (hinted, plain) and the rewrite settings; the strength of a preference's wording only on the
weights, the wordings and those settings. A general prompt or rehearsal question answered for the
standing preferences is kept under the preferences' ids rather than their words: when a later
correction brings a stronger wording of the same preference, the answers written for the earlier
one still show it, and are reused for one run while the prepare step writes new ones. So a run reuses what was computed for the same weights
before: above all what the prepare step (`recipe --prepare`, run by the flow right after a
promotion, while the user talks) wrote for the next run's general prompts and rehearsal. A run
whose preferences or champion changed since finds nothing to reuse and computes as before.

One JSON file per (weights, settings); a file that cannot be read counts as empty.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from clawflow.config import TrainConfig
from clawflow.policy.loader import weights_stamp

KEEP_FILES = 4  # the champion's, and a few recent others (a rollback finds its own again)


def rewrite_settings(cfg: TrainConfig) -> dict:
    """The train settings a rewrite's tokens depend on (the teacher is the weights the cache is keyed by)."""
    return {k: v for k, v in cfg.model_dump().items() if k.startswith("rewrite_") and k != "rewrite_teacher"} \
        | {"seed": cfg.seed}


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:24]


class RewriteCache:
    """{(hinted prompt, plain prompt): reply tokens} and {preferences: what their wordings measured}
    for one set of weights."""

    def __init__(self, root: str | Path | None, model_dir: str | Path, cfg: TrainConfig):
        self.root = Path(root) if root else None
        key = _digest([weights_stamp(model_dir), rewrite_settings(cfg)])
        self.path = self.root / f"rewrites-{key}.json" if self.root else None
        self.data = self._read()

    def _read(self) -> dict:
        if not self.path or not self.path.is_file():
            return {"replies": {}, "strengths": {}}
        try:
            data = json.loads(self.path.read_text())
            return {"replies": dict(data.get("replies", {})), "strengths": dict(data.get("strengths", {}))}
        except (OSError, ValueError, AttributeError):
            return {"replies": {}, "strengths": {}}

    @staticmethod
    def item_key(teacher, prompt: list[int]) -> str:
        """`teacher`: what the reply was written from (the hinted prompt's ids, or any JSON-able
        description of it, see `Recipe.teacher_key`)."""
        return _digest([teacher if isinstance(teacher, (str, dict)) else list(teacher), list(prompt)])

    def reply(self, teacher, prompt: list[int]) -> list[int] | None:
        found = self.data["replies"].get(self.item_key(teacher, prompt))
        return list(found) if found is not None else None

    def add_replies(self, pairs) -> None:
        """`pairs`: ((teacher, plain prompt), reply tokens); written at once."""
        for (teacher, plain), reply in pairs:
            self.data["replies"][self.item_key(teacher, plain)] = list(reply)
        self._write()

    def preference_report(self, preferences) -> dict | None:
        """What `Recipe.use_preferences` measured for these preferences (any JSON-able description)."""
        return self.data["strengths"].get(_digest(preferences))

    def add_preference_report(self, preferences, report: dict) -> None:
        self.data["strengths"][_digest(preferences)] = report
        self._write()

    def _write(self) -> None:
        if not self.path:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.data))
        tmp.replace(self.path)  # readers see the old file or the new one, never half of one


def prune(root: str | Path, keep: int = KEEP_FILES) -> list[Path]:
    """Delete all but the `keep` most recently written cache files (one per set of weights: a run
    only reads its champion's); returns what was deleted."""
    files = sorted(Path(root).glob("rewrites-*.json"), key=lambda f: f.stat().st_mtime_ns, reverse=True)
    for f in files[keep:]:
        f.unlink(missing_ok=True)
    return files[keep:]
