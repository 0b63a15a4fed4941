"""Embedded judge (the laptop default, no second LLM): MiniLM embeddings of the next state,
compared with labelled exemplars, classified by a small logistic head, plus hint extraction.

The head is trained at build time (`python -m clawflow.judge.embedded build`) on
`configs/judge/exemplars.jsonl` and the *train* split of `configs/judge/labelled.jsonl`, and
shipped as `configs/judge/embedded_head.safetensors` with the exemplar embeddings and a hash of
its training data. When the data changed since, the head is rebuilt in memory at load (a few
seconds) so the judge never runs stale. Limits: see README "Judge".
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from functools import lru_cache
from pathlib import Path

import torch

from clawflow.config import REPO_ROOT, JudgeConfig
from clawflow.judge.base import JudgeInput, Judgment
from clawflow.judge.dataset import load_labelled
from clawflow.judge.features import CLASSES, clauses, feature_vector
from clawflow.judge.head import Head, fit
from clawflow.judge.hints import HINTS_VERSION, extract_hint
from clawflow.judge.minilm import MODEL_ID, MiniLM

log = logging.getLogger(__name__)
FEATURES_VERSION = "2"
L2 = 0.03  # chosen by 5-fold cross-validation on the train split (bench/judge_cv.py)
GIST_CHARS = 64  # request and reply matter by their gist; CV: 0.907 at 64, 0.906 at 120 and 240 (slower)
ROLES = ("user", "tool")
DATA_DIR = REPO_ROOT / "configs" / "judge"


@lru_cache(maxsize=4)
def shared_encoder(threads: int | None = 1) -> MiniLM:
    return MiniLM(threads=threads)


def _paths(cfg: JudgeConfig) -> tuple[Path, Path, Path]:
    e = cfg.embedded
    return (Path(e.head or DATA_DIR / "embedded_head.safetensors"), Path(e.exemplars or DATA_DIR / "exemplars.jsonl"),
            Path(e.labelled or DATA_DIR / "labelled.jsonl"))


def state_text(item: JudgeInput) -> str:
    """The next state's text for its role (several tool results are read together)."""
    texts = [str(m.get("content") or "") for m in item.next_state if m.get("role", item.next_role) == item.next_role]
    return "\n".join(texts)


def request_text(item: JudgeInput) -> str:
    return next((str(m.get("content") or "") for m in reversed(item.context) if m.get("role") == "user"), "")


def reply_text(item: JudgeInput) -> str:
    calls = item.turn.get("tool_calls") or []
    names = [f"{c.get('function', {}).get('name')}({c.get('function', {}).get('arguments', '')})" for c in calls]
    return "\n".join([str(item.turn.get("content") or "")] + names).strip()


def data_hash(exemplars: Path, labelled: Path) -> str:
    train = [i.id for i in load_labelled(labelled, "train")]
    h = hashlib.sha256(exemplars.read_bytes() + labelled.read_bytes() + json.dumps(train).encode())
    h.update(f"{MODEL_ID}/{FEATURES_VERSION}/{L2}/{GIST_CHARS}".encode())
    return h.hexdigest()


def _read_exemplars(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class EmbeddedJudge:
    name = "embedded"

    def __init__(self, cfg: JudgeConfig, encoder: MiniLM | None = None):
        head_path, exemplars_path, labelled_path = _paths(cfg)
        self.cfg = cfg
        self.encoder = encoder or shared_encoder(cfg.embedded.threads)
        self.exemplars = {r: [e for e in _read_exemplars(exemplars_path) if e["role"] == r] for r in ROLES}
        digest = data_hash(exemplars_path, labelled_path)
        tensors = _load_head(head_path, digest)
        if tensors is None:
            log.warning("%s is missing or older than its training data; rebuilding it in memory", head_path)
            tensors = build_tensors(self.encoder, self.exemplars, labelled_path)
        self.exemplar_emb = {r: tensors[f"{r}.exemplars"] for r in ROLES}
        self.heads = {r: Head(*(tensors[f"{r}.{k}"] for k in ("weight", "bias", "mean", "std"))) for r in ROLES}
        hints = f"h{HINTS_VERSION}.{cfg.hint_min_chars}{cfg.hints[0]}"
        self.version = f"{MODEL_ID}+{digest[:10]}+{hints}" + ("" if cfg.include_request else "-noreq")

    def features(self, item: JudgeInput) -> tuple[str, str, torch.Tensor]:
        return item_features(self.encoder, self.exemplars, self.exemplar_emb, item, self.cfg.include_request)

    def classify(self, item: JudgeInput) -> tuple[int, list[float], str]:
        role, text, x = self.features(item)
        probs = self.heads[role].probs(x)[0]
        return CLASSES[int(probs.argmax())], [round(float(p), 3) for p in probs], text

    async def __call__(self, item: JudgeInput) -> Judgment:
        score, probs, text = self.classify(item)
        hint = None
        wants = self.cfg.hints == "always" or (self.cfg.hints == "nonzero" and score != 0)
        if wants and item.next_role != "tool":
            hint = extract_hint(text, self.cfg.hint_min_chars)
        why = f"p(-1,0,+1)={tuple(probs)} from the {item.next_role} next state"
        return Judgment(score, [score], why, hint, self.name, {"probs": probs}, self.version)


def item_features(encoder: MiniLM, exemplars: dict[str, list[dict]], exemplar_emb: dict[str, torch.Tensor],
                  item: JudgeInput, include_request: bool = True) -> tuple[str, str, torch.Tensor]:
    """(role, next-state text, (1, f) features), one batched encoder call per turn."""
    role = "tool" if item.next_role == "tool" else "user"
    text = state_text(item)
    parts = clauses(text)
    request = request_text(item)[:GIST_CHARS] if include_request else ""
    emb = encoder.embed(parts + [request, reply_text(item)[:GIST_CHARS]])
    k = len(parts)
    vec = feature_vector(role, text, emb[:k], exemplar_emb[role], [e["label"] for e in exemplars[role]],
                         emb[k] if include_request else None, emb[k + 1])
    return role, text, torch.tensor([vec])


def _load_head(path: Path, digest: str) -> dict[str, torch.Tensor] | None:
    from safetensors import safe_open

    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("data_sha256") != digest:
            return None
        names = list(f.keys())  # noqa: SIM118 - a safetensors handle is not iterable
        return {k: f.get_tensor(k) for k in names}


def build_tensors(encoder: MiniLM, exemplars: dict[str, list[dict]], labelled: Path) -> dict[str, torch.Tensor]:
    """Embed the exemplars and fit one head per role on the labelled train split."""
    emb = {r: encoder.embed([e["text"] for e in exemplars[r]]) for r in ROLES}
    rows: dict[str, list] = {r: [] for r in ROLES}
    for item in load_labelled(labelled, "train"):
        role, _, x = item_features(encoder, exemplars, emb, item.input)
        rows[role].append((x[0], item.label))
    out = {f"{r}.exemplars": emb[r] for r in ROLES}
    for r in ROLES:
        head = fit(torch.stack([x for x, _ in rows[r]]), [y for _, y in rows[r]], L2)
        out.update({f"{r}.weight": head.weight, f"{r}.bias": head.bias, f"{r}.mean": head.mean, f"{r}.std": head.std})
    return out


def build(cfg: JudgeConfig | None = None) -> Path:
    """Rebuild the shipped head file from configs/judge/ (run after editing the data)."""
    from safetensors.torch import save_file

    cfg = cfg or JudgeConfig()
    head_path, exemplars_path, labelled_path = _paths(cfg)
    exemplars = {r: [e for e in _read_exemplars(exemplars_path) if e["role"] == r] for r in ROLES}
    tensors = build_tensors(shared_encoder(), exemplars, labelled_path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(head_path),
              metadata={"data_sha256": data_hash(exemplars_path, labelled_path), "model": MODEL_ID,
                        "features_version": FEATURES_VERSION, "l2": str(L2)})
    head_path.chmod(0o644)
    return head_path


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        sys.exit("usage: python -m clawflow.judge.embedded build")
    print(build())
