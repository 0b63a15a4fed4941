"""The trainer's configuration section (`train:`); read by clawflow/train. Loss math: train/loss.py."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from clawflow.config.base import _Strict


class LoraSpec(_Strict):
    """LoRA (Hu et al. 2021) via peft: adapter-only checkpoints of a few MB."""

    r: int = Field(16, ge=1)  # adapter rank
    alpha: int = Field(32, ge=1)  # the adapter's update is scaled by alpha / r
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # on the adapter's input
    # Linear layers that get an adapter
    target_modules: list[str] = Field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


class TrainConfig(_Strict):
    """The trainer (clawflow/train). Loss math: clawflow/train/loss.py and advantages.py."""

    lr: float = 1e-6  # AdamW learning rate
    epochs: int = Field(1, ge=1)  # passes over one run's batch
    micro_batch: int = Field(4, ge=1)  # sequences per forward pass
    step_tokens: int = Field(8192, ge=1)  # response tokens per optimizer step (gradient accumulation)
    max_turns: int = 256  # largest batch one training run takes, oldest first
    # per-user training (a LoRA recipe): a user's version line trains only once at least this many of
    # their turns with a next state wait; with fewer they wait for a later run
    min_turns: int = Field(4, ge=1)
    # objective: binary RL, OPD from hindsight hints, or both (a turn without a hint has no OPD term);
    # distill: RL on the recorded replies, and each corrected turn's reply rewritten by the policy
    # with the hint in its prompt, learned from the plain prompt (context distillation: train/rewrite.py)
    objective: Literal["rl", "opd", "combined", "distill"] = "combined"
    rl_weight: float = 1.0  # scale of the RL term
    opd_weight: float = 1.0  # scale of the OPD term
    distill_weight: float = Field(1.0, gt=0.0)  # per-token NLL weight of a rewritten reply
    # A rewritten reply's target at each position: 0 = its sampled token (SFT); k = the teacher's k
    # likeliest tokens weighted by its renormalized probabilities (context distillation on the
    # teacher's distribution, Askell et al. 2021 / Snell et al. 2022): train/loss.py `topk_distill_per_token`
    distill_topk: int = Field(0, ge=0, le=256)
    # scales A < 0 (replies judged bad); on one reply per prompt a −1 only says "not this", and
    # pushing sampled replies down is what drove SmolLM2 into non-answers (issue #15)
    negative_weight: float = Field(1.0, ge=0.0)
    rewrite_max_tokens: int = Field(128, ge=1)  # longest rewritten reply
    # Who writes the rewrites (and the top-k targets): `policy`, the start-of-run weights with the hint;
    # `base`, the frozen base with it. A base teacher is the same every run, so a version's slips
    # (a wrong fact, a loop) are never its successor's targets, and its rewrites are kept across
    # versions (train/rewrite_cache.py keys them by the teacher's weights)
    rewrite_teacher: Literal["policy", "base"] = "policy"
    rewrite_hint: Literal["user", "system"] = "system"  # where the rewriting policy reads the hint (train/teacher.py)
    # Best of n: the greedy rewrite and `rewrite_samples` sampled ones; the usable one chosen by
    # `rewrite_select` is learned (train/rewrite.py `choose`). 0: the greedy rewrite alone.
    rewrite_samples: int = Field(0, ge=0)
    rewrite_temperature: float = Field(0.7, gt=0.0)  # of the sampled rewrites
    # plain: the most likely under the plain prompt; poe: under both; greedy
    rewrite_select: Literal["plain", "poe", "greedy"] = "plain"
    # γ of classifier-free guidance while rewriting: log p_hinted + γ (log p_hinted − log p_plain)
    # amplifies what the hint changes (train/rewrite.py `guided`); 0 = the hinted policy as it is.
    rewrite_guidance: float = Field(0.0, ge=0.0)
    # A rewrite is learned only if it shows every stance of its teacher's hint that a reply can be
    # checked against ("at most 30 words", "all lowercase", "a bullet list", "end with a question":
    # prefs/shows.py), and best-of-N prefers candidates that do. A teacher that cannot show a
    # preference otherwise teaches what the preference did to it instead (shorter answers, not lowercase).
    verify_stances: bool = True
    # `own`: each rewrite reads its turn's hint; `strongest`: every rewrite (and rehearsal) reads the
    # run's hint that changes the policy's answers most ("Answer in no more than 30 words." rather
    # than "That's way too long.", which a small model ignores): train/rewrite.py `hint_strength`
    rewrite_hints: Literal["own", "strongest"] = "own"
    # distill: general questions per run answered by the policy with one of the run's correction hints,
    # learned when they still state their key fact (train/rehearsal.py); 0 = off.
    # Questions: default configs/train/rehearsal.yaml
    rehearsal: int = Field(0, ge=0)
    rehearsal_prompts: Path | None = None  # None: configs/train/rehearsal.yaml
    # Standing preferences (clawflow/prefs): each run also distils the user's active preferences over
    # `broad_prompts` general prompts drawn afresh per run from `broad_prompts_file` (default
    # configs/train/prompts.yaml); the teacher is the policy with the preferences in its system
    # prompt, best-of-n chosen by the plain policy (train/plan.py `broad_items`). 0 = off.
    broad_prompts: int = Field(0, ge=0)
    broad_prompts_file: Path | None = None  # the general prompts to draw from (None: configs/train/prompts.yaml)
    max_preferences: int = Field(4, ge=1)  # the teacher reads the strongest this many
    # After a run, a niced process writes the next run's rehearsal and general-prompt rewrites from
    # the champion while the user talks (`recipe --prepare`, train/rewrite_cache.py): the next
    # round then only rewrites its own corrected turns. Off: each run rewrites everything itself.
    prepare_next: bool = True
    teacher: Literal["policy", "base"] = "policy"  # OPD teacher: the served policy (bench/opd_teacher.py), or the base
    opd_clip: float | None = Field(None, gt=0)  # bound |teacher - old| per token
    group_norm: bool = True  # GRPO (r - mean) / std within a group of samples of one prompt
    eps_low: float = Field(0.2, ge=0.0, lt=1.0)  # PPO clip; clip-higher (DAPO, Yu et al. 2025)
    eps_high: float = Field(0.28, ge=0.0)  # upper PPO clip (clip-higher)
    dual_clip: float | None = Field(None, gt=1.0)  # dual-clip PPO (Ye et al. 2020), e.g. 3.0
    tis_cap: float | None = Field(2.0, gt=0)  # truncated importance sampling vs rollout logprobs; None: off
    kl_beta: float = Field(0.0, ge=0.0)  # k3 KL to the frozen base; 0 never runs the base
    # The KL's reference: `base`, the frozen base (the adapter switched off); `start`, the run's start
    # weights (the champion): each run then moves from the version users have, not back toward the base
    kl_reference: Literal["base", "start"] = "base"
    # loss mean per sequence, then over sequences; or over all tokens
    aggregation: Literal["seq_mean", "token_mean"] = "seq_mean"
    max_staleness: int | None = Field(None, ge=0)  # policy versions; None = no bound
    staleness: Literal["drop", "decay"] = "drop"  # beyond max_staleness: drop the turn, or weight it by staleness_decay
    staleness_decay: float = Field(0.5, gt=0.0, le=1.0)  # weight factor per version beyond max_staleness
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float | None = Field(1.0, gt=0)  # max gradient norm; None: no clipping
    warmup_steps: int = Field(0, ge=0)  # linear learning-rate warm-up
    lr_schedule: Literal["constant", "cosine"] = "constant"  # after the warm-up
    activation_checkpointing: bool = False  # recompute activations in backward: less memory, slower
    mixed_precision: bool = True  # GPU: bf16 compute, fp32 weights and reductions
    # CPU: bf16 autocast (fp32 weights) where a start-up probe finds a training step clearly faster
    # (train/precision.py); `bfloat16` or `off` skip the probe
    autocast: Literal["auto", "bfloat16", "off"] = "auto"
    lora: LoraSpec | None = None  # None: train full weights; set: a LoRA adapter (the `lora` extra)
    resume_every: int = Field(20, ge=0)  # steps between resumable states; 0 = only when interrupted
    keep_optimizer: bool = True  # save AdamW state with the checkpoint; the next run continues it
    seed: int = 0  # seed of the run's sampling and shuffling
    nproc: int = 1  # torchrun --nproc_per_node
    # Multi-node (torchrun's c10d rendezvous): every node runs the same training command with its
    # own node_rank; 1 node = `--standalone`. rdzv_endpoint is host:port of a node all can reach.
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)  # this node's rank; node 0 runs the flow's training task
    rdzv_endpoint: str | None = None  # e.g. "trainer-0.internal:29400"
    rdzv_id: str = "clawflow"  # the job's id: the same on every node, new for each job
    rdzv_timeout_s: float = Field(900.0, gt=0)  # give up when the other nodes have not joined by then
    threads: int | None = None  # torch threads per training process; None: torch's default
    peak_flops: float | None = None  # MFU denominator (FLOP/s); None = measured matmul peak

    @model_validator(mode="after")
    def _multinode(self) -> "TrainConfig":
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("nnodes > 1 needs rdzv_endpoint (host:port of the c10d rendezvous)")
        return self
