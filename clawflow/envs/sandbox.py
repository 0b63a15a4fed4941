"""A throwaway shell sandbox for the terminal environment's `run_shell` tool.

Each episode gets its own temp directory as cwd and HOME. Per command: a wall-clock limit (the
whole process group is killed), output capped (the rest is drained and dropped, so `yes` cannot
fill memory), a minimal environment (PATH, HOME, TMPDIR, LANG only), file sizes limited by
RLIMIT_FSIZE. Isolation, best effort and layered:
  * lexical refusal: commands naming absolute paths (other than /dev/null), `~`, or `..` are
    refused before anything runs;
  * no network: `unshare -n` (as root) or `unshare -rn` (user namespaces) when available;
  * as root, commands run as `nobody` (setpriv), so they cannot write root-owned files.
What this does NOT stop: a command that builds a path at run time (e.g. `$(printf '\\x2ftmp')`)
can still write where `nobody` may (world-writable dirs like /tmp). Run untrusted policies in a
container for more.
"""

from __future__ import annotations

import functools
import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
_D = r"(?:^|[\s'\"=:<>|;&(`{,])"  # where a path word starts
# /<an entry of the real root> (not /dev/null), a bare `/`, `~`, or a `..` component: sed's
# `s/a/b/` and awk's `-F/` stay allowed.
_OUTSIDE = re.compile(
    _D + r"/(?:(?!dev/null\b)(?:" + "|".join(re.escape(n) for n in sorted(os.listdir("/"))) + r")\b|(?=[\s;&|)]|$))"
    + r"|" + _D + r"~|(?:^|[/\s'\"=:<>|;&(`{,])\.\.(?:/|$|[\s'\";|&)])")
FSIZE_LIMIT = 16 * 1024 * 1024


@dataclass
class ShellResult:
    output: str
    exit_code: int | None  # None: refused or killed
    timed_out: bool = False
    truncated: bool = False
    refused: str | None = None

    def render(self) -> str:
        """The tool message the policy sees."""
        if self.refused:
            return f"refused: {self.refused}"
        tail = []
        if self.truncated:
            tail.append("[output truncated]")
        if self.timed_out:
            tail.append("[killed: time limit]")
        else:
            tail.append(f"[exit code {self.exit_code}]")
        return (self.output + ("\n" if self.output and not self.output.endswith("\n") else "") + " ".join(tail))


def refusal(command: str) -> str | None:
    """Why `command` is refused (it names a path outside the sandbox), or None."""
    if _OUTSIDE.search(command):
        return "commands may only use relative paths inside the sandbox (no /abs/paths, ~ or ..)"
    return None


def _works(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
def isolation() -> tuple[tuple[str, ...], bool]:
    """(argv prefix, drops to nobody): what this machine supports, probed once."""
    root = os.geteuid() == 0
    drop = root and shutil.which("setpriv") is not None and _works(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "true"])
    if shutil.which("unshare"):
        for prefix in (["unshare", "-n"], ["unshare", "-rn"]):
            if _works([*prefix, "true"]):
                return (*prefix, *(_drop_argv() if drop else ())), drop
    return tuple(_drop_argv()) if drop else (), drop


def _drop_argv() -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def _limits() -> None:  # in the child, before exec
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))


class Sandbox:
    def __init__(self, timeout_s: float = 5.0, output_cap: int = 4096):
        self.dir = Path(tempfile.mkdtemp(prefix="clawflow-sandbox-")).resolve()
        self.timeout_s = timeout_s
        self.output_cap = output_cap
        self.prefix, self.drops = isolation()

    def write(self, files: dict[str, str]) -> None:
        for rel, content in files.items():
            path = (self.dir / rel).resolve()
            if not path.is_relative_to(self.dir):
                raise ValueError(f"task file outside the sandbox: {rel}")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)

    def _own(self) -> None:
        if self.drops:  # let `nobody` work in its own directory
            for root, dirs, files in os.walk(self.dir):
                for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                    os.chown(name, NOBODY, NOBODY)

    def run(self, command: str) -> ShellResult:
        if why := refusal(command):
            return ShellResult("", None, refused=why)
        self._own()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.dir), "TMPDIR": str(self.dir),
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        argv = [*self.prefix, "bash", "--noprofile", "--norc", "-c", command]
        proc = subprocess.Popen(argv, cwd=self.dir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_limits)
        kept = bytearray()
        total = [0]

        def drain() -> None:  # keep the first `output_cap` bytes, drop the rest
            while chunk := proc.stdout.read1(65536):
                total[0] += len(chunk)
                if len(kept) < self.output_cap:
                    kept.extend(chunk[: self.output_cap - len(kept)])

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(self.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        try:  # stragglers left in the background would hold the pipe open
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reader.join(5)
        proc.stdout.close()
        return ShellResult(kept.decode(errors="replace"), None if timed_out else proc.returncode,
                           timed_out=timed_out, truncated=total[0] > self.output_cap)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
