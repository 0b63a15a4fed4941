"""Process reward judges: score an assistant turn from its next state (+1 / −1 / 0).

Backends (`judge.backend`): `embedded` (MiniLM + exemplars, the default when no endpoint is
configured), `llm` (any OpenAI-compatible endpoint, m votes), `rules` (lexical baseline); `auto`
picks `llm` when `judge.llm.base_url` is set, else `embedded`. Heavy modules load on first use.
"""

from clawflow.judge.base import Judge, JudgeInput, JudgeUnavailable, Judgment, judge_many, majority
from clawflow.judge.rules import RuleJudge

__all__ = [
    "BACKENDS",
    "Judge",
    "JudgeInput",
    "JudgeUnavailable",
    "Judgment",
    "RuleJudge",
    "judge_many",
    "majority",
    "make_judge",
]

BACKENDS = ("auto", "embedded", "llm", "rules")


def make_judge(cfg, backend: str | None = None) -> Judge:
    """The judge the config names (`judge.backend`), or `backend` when given."""
    jc = cfg.judge
    name = jc.resolved_backend if backend in (None, "auto") else backend
    if name == "rules":
        return RuleJudge()
    if name == "embedded":
        from clawflow.judge.embedded import EmbeddedJudge

        return EmbeddedJudge(jc, home=cfg.home)
    if name == "llm":
        if not jc.llm.base_url:
            raise ValueError("the llm judge needs judge.llm.base_url in the config")
        from clawflow.judge.llm import LLMJudge

        return LLMJudge(jc)
    raise ValueError(f"unknown judge backend {name!r} (choose from {', '.join(BACKENDS)})")
