"""Process reward judges: score an assistant turn from its next state (+1 / −1 / 0)."""

from clawflow.judge.base import Judge, JudgeInput, Judgment, judge_many, majority
from clawflow.judge.rules import RuleJudge

__all__ = ["Judge", "JudgeInput", "Judgment", "RuleJudge", "judge_many", "majority", "make_judge"]


def make_judge(cfg) -> Judge:
    """The judge the config names (`judge.backend`)."""
    if cfg.judge.backend == "rules":
        return RuleJudge()
    raise ValueError(f"unknown judge backend {cfg.judge.backend!r}")
