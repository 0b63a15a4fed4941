"""Gateway replicas follow the registry's `champion` alias.

Behind a load balancer, the training flow's reload (`POST /admin/reload` at `serving.public_url`)
reaches one replica. With `registry.follow_champion_s` set, every gateway also looks at
`champion` that often and, when it names another version than the one served (a promotion, a
rollback), fetches it the way /admin/reload does (a verified download from a tracking server)
and swaps it in. A look that fails (registry down, a checkpoint failing its checksum) is logged
and the gateway keeps serving what it has; the next look tries again. A version reloaded by path
(not the champion) is replaced by the champion at the next look: following means serving it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from clawflow.config import Config
from clawflow.serving.engine_protocol import Engine

log = logging.getLogger("clawflow.serving.follow")


class ChampionFollower:
    def __init__(self, cfg: Config, engine: Engine, resolve: Callable[[int | str], tuple[int, str]],
                 interval_s: float, on_reload: Callable[[int, str, float], None] | None = None):
        self.cfg, self.engine, self.resolve = cfg, engine, resolve
        self.interval_s = interval_s
        self.on_reload = on_reload
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_error = ""  # a failure repeating every look is logged once

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="clawflow-follow-champion", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None

    def check(self) -> int | None:
        """One look: the version swapped in, or None when the champion is already served."""
        from clawflow.policy import registry

        found = registry.champion(self.cfg)
        if found is None or found[0] == self.engine.policy_version:
            return None
        version, path = self.resolve(found[0])
        seconds = self.engine.reload(path, version)
        log.info("followed champion: serving v%s from %s (swapped in %.1f s)", version, path, seconds)
        if self.on_reload is not None:
            self.on_reload(version, path, seconds)
        return version

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
                self._last_error = ""
            except Exception as exc:  # noqa: BLE001 - keep serving; the next look retries
                error = f"{exc.__class__.__name__}: {str(exc)[:300]}"
                log.log(logging.DEBUG if error == self._last_error else logging.WARNING,
                        "could not follow champion (still serving v%s): %s", self.engine.policy_version, error)
                self._last_error = error
