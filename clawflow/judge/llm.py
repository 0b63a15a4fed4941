"""LLM judge: m votes of a PRM prompt on any OpenAI-compatible endpoint, majority, plus hints.

Transport policy: retries with exponential backoff and jitter on 429, 5xx, timeouts and
connection errors (honouring Retry-After); other 4xx are configuration errors and are not
retried. A bounded number of requests are in flight. A per-run budget (requests and/or tokens)
caps cost. Whenever a turn cannot get all its votes, `JudgeUnavailable` is raised: the turn stays
unjudged and a later run retries it. Once one turn has exhausted its retries on a dead endpoint,
the rest of the run fails fast instead of waiting through the same retries for every turn. A reply that arrives but boxes no valid value is an invalid
vote (None), which the majority ignores; all invalid → 0.
"""

from __future__ import annotations

import asyncio
import os
import random

import httpx

from clawflow.config import JudgeConfig
from clawflow.envelopes import VERSION as ENVELOPES_VERSION
from clawflow.judge.base import JudgeInput, JudgeUnavailable, Judgment, majority
from clawflow.judge.parse import extract_hint, parse_boxed, rationale, select_hint
from clawflow.judge.prompts import fingerprint, load_prompt, messages

RETRYABLE = {408, 409, 425, 429}


class BudgetSpent(JudgeUnavailable):
    """This run's judge budget is spent; the remaining turns wait for the next run."""


class LLMJudge:
    name = "llm"

    def __init__(self, cfg: JudgeConfig):
        self.cfg, self.llm = cfg, cfg.llm
        self.prm = load_prompt(cfg.prm_prompt)
        self.hint_prompt = load_prompt(cfg.hint_prompt) if cfg.hints != "off" else None
        used = [self.prm] + ([self.hint_prompt] if self.hint_prompt else [])
        self.prompt_version = "+".join(p.version for p in used)
        self.version = fingerprint(self.llm.model, [(p.version, p.digest) for p in used], cfg.votes,
                                   self.llm.temperature, cfg.include_request, cfg.context_messages,
                                   cfg.hints, cfg.hint_min_chars, f"env{ENVELOPES_VERSION}")
        self.requests = self.tokens = self.retries = 0
        self.down: str | None = None  # set when the endpoint failed a turn after all retries
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # one per event loop (judge_pairs runs a loop per batch)
            self._sem, self._loop = asyncio.Semaphore(self.llm.concurrency), loop
        return self._sem

    def _client(self) -> httpx.AsyncClient:
        key = self.llm.api_key or os.environ.get("CLAWFLOW_JUDGE_API_KEY")
        headers = dict(self.llm.headers) | ({"Authorization": f"Bearer {key}"} if key else {})
        return httpx.AsyncClient(base_url=self.llm.base_url.rstrip("/") + "/", headers=headers,
                                 timeout=self.llm.timeout_s)

    def _spend(self) -> None:
        if self.llm.budget_requests is not None and self.requests >= self.llm.budget_requests:
            raise BudgetSpent(f"judge budget spent: {self.requests} requests")
        if self.llm.budget_tokens is not None and self.tokens >= self.llm.budget_tokens:
            raise BudgetSpent(f"judge budget spent: {self.tokens} tokens")
        self.requests += 1

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        if retry_after and retry_after.replace(".", "", 1).isdigit():
            return min(float(retry_after), self.llm.backoff_max_s)
        base = min(self.llm.backoff_s * 2 ** attempt, self.llm.backoff_max_s)
        return base * (0.5 + random.random() / 2)

    async def complete(self, client: httpx.AsyncClient, chat: list[dict]) -> str:
        """One chat completion's text; retries transient failures, raises JudgeUnavailable."""
        body = {"model": self.llm.model, "messages": chat, "temperature": self.llm.temperature,
                "max_tokens": self.llm.max_tokens}
        if self.down:
            raise JudgeUnavailable(f"judge endpoint is down this run ({self.down})")
        problem = "no attempt"
        for attempt in range(self.llm.max_retries + 1):
            self._spend()
            retry_after = None
            try:
                async with self._semaphore():
                    r = await client.post("chat/completions", json=body)
            except httpx.TransportError as exc:  # connect errors, timeouts, broken connections
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if r.status_code == 200:
                    return self._content(r)
                problem = f"HTTP {r.status_code}: {r.text[:200]}"
                if r.status_code not in RETRYABLE and r.status_code < 500:
                    raise JudgeUnavailable(f"judge endpoint refused the request ({problem})")
                retry_after = r.headers.get("retry-after")
            if attempt < self.llm.max_retries:
                self.retries += 1
                await asyncio.sleep(self._delay(attempt, retry_after))
        self.down = problem
        raise JudgeUnavailable(f"judge endpoint failed after {self.llm.max_retries + 1} attempts ({problem})")

    def _content(self, r: httpx.Response) -> str:
        try:
            data = r.json()
            self.tokens += int((data.get("usage") or {}).get("total_tokens") or 0)
            return str(data["choices"][0]["message"].get("content") or "")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return ""  # a malformed answer is an invalid vote, not a crash

    async def _votes(self, client: httpx.AsyncClient, chat: list[dict]) -> list[str]:
        async with asyncio.TaskGroup() as tg:  # one failure cancels the others
            tasks = [tg.create_task(self.complete(client, chat)) for _ in range(self.cfg.votes)]
        return [t.result() for t in tasks]

    async def __call__(self, item: JudgeInput) -> Judgment:
        ctx = (self.cfg.include_request, self.cfg.context_messages)
        try:
            async with self._client() as client:
                replies = await self._votes(client, messages(self.prm, item, *ctx))
                votes = [parse_boxed(r) for r in replies]
                score = majority(votes)
                hint, hint_votes = None, 0
                if self.hint_prompt and (self.cfg.hints == "always" or score != 0):
                    hint_replies = await self._votes(client, messages(self.hint_prompt, item, *ctx))
                    candidates = [extract_hint(r) for r in hint_replies]
                    hint_votes = sum(c is not None for c in candidates)
                    hint = select_hint(candidates, self.cfg.hint_min_chars)
        except* JudgeUnavailable as group:
            raise group.exceptions[0] from None
        why = next((rationale(r) for r, v in zip(replies, votes) if v == score), "no valid vote")
        return Judgment(score, votes, why, hint, self.name, {"hint_votes": hint_votes}, self.version,
                        self.prompt_version)
