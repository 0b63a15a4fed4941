"""Embedded judge (the laptop default, no second LLM): MiniLM embeddings of the next state,
compared with labelled exemplars, plus a reader LM's probe (`reader.py`), stacked in a small
logistic head (`stack.py`), plus hint extraction.

The heads are trained at build time (`python -m clawflow.judge.embedded build`) on
`configs/judge/exemplars.jsonl` and the *train* split of `configs/judge/labelled.jsonl`, and
shipped as `configs/judge/embedded_head.safetensors` with the exemplar embeddings and a hash of
its training data. When the data changed since, the head is rebuilt in memory at load (a few
seconds) so the judge never runs stale. Limits: see docs/judge.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import torch

from clawflow.config import REPO_ROOT, JudgeConfig, default_home
from clawflow.envelopes import VERSION as ENVELOPES_VERSION
from clawflow.judge.base import JudgeInput, Judgment
from clawflow.judge.dataset import load_labelled
from clawflow.judge.features import CLASSES, clauses, feature_vector
from clawflow.judge.head import Head
from clawflow.judge.hints import HINTS_VERSION, extract_hint
from clawflow.judge.minilm import MODEL_ID, MiniLM
from clawflow.judge.reader import READER_VERSION, Reader
from clawflow.judge.stack import fit_stacked, stacked_probs

log = logging.getLogger(__name__)
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="judge-reader")
FEATURES_VERSION = "4"
L2 = 0.03  # chosen by 5-fold cross-validation on the train split (bench/judge_cv.py)
L2_READER = 0.03  # the reader's probe (576 features): same CV
STACK_FOLDS = 5
GIST_CHARS = 64  # request and reply matter by their gist; CV: 0.907 at 64, 0.906 at 120 and 240 (slower)
ROLES = ("user", "tool")
DATA_DIR = REPO_ROOT / "configs" / "judge"


@lru_cache(maxsize=4)
def shared_encoder(threads: int | None = 1) -> MiniLM:
    return MiniLM(threads=threads)


@lru_cache(maxsize=4)
def _shared_reader(path: str, layers: int, threads: int | None, int8: bool) -> Reader:
    return Reader(path, layers=layers, threads=threads, int8=int8)


def shared_reader(cfg: JudgeConfig, home: Path | None = None) -> Reader:
    from clawflow.base_model import model_dir

    e = cfg.embedded
    return _shared_reader(model_dir(e.reader, home or default_home()), e.reader_layers, e.threads, e.reader_int8)


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


def data_hash(exemplars: Path, labelled: Path, cfg: JudgeConfig | None = None) -> str:
    e = (cfg or JudgeConfig()).embedded
    train = [i.id for i in load_labelled(labelled, "train")]
    h = hashlib.sha256(exemplars.read_bytes() + labelled.read_bytes() + json.dumps(train).encode())
    h.update(f"{MODEL_ID}/{FEATURES_VERSION}/{L2}/{GIST_CHARS}".encode())
    h.update(f"/reader {READER_VERSION} {e.reader.name} {e.reader_layers} {e.reader_int8} {L2_READER} {STACK_FOLDS}".encode())
    return h.hexdigest()


def _read_exemplars(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class EmbeddedJudge:
    name = "embedded"

    def __init__(self, cfg: JudgeConfig, encoder: MiniLM | None = None, reader: Reader | None = None,
                 home: Path | None = None):
        head_path, exemplars_path, labelled_path = _paths(cfg)
        self.cfg = cfg
        self.encoder = encoder or shared_encoder(cfg.embedded.threads)
        self.reader = reader or shared_reader(cfg, home)
        self.exemplars = {r: [e for e in _read_exemplars(exemplars_path) if e["role"] == r] for r in ROLES}
        digest = data_hash(exemplars_path, labelled_path, cfg)
        tensors = _load_head(head_path, digest)
        if tensors is None:
            log.warning("%s is missing or older than its training data; rebuilding it in memory", head_path)
            tensors = build_tensors(self.encoder, self.reader, self.exemplars, labelled_path)
        self.exemplar_emb = {r: tensors[f"{r}.exemplars"] for r in ROLES}
        self.heads = {r: _head(tensors, r) for r in ROLES}
        self.probes = {r: _head(tensors, f"{r}.reader") for r in ROLES}
        hints = f"h{HINTS_VERSION}.{cfg.hint_min_chars}{cfg.hints[0]}"
        self.version = (f"{MODEL_ID}+{digest[:10]}+{hints}+env{ENVELOPES_VERSION}"
                        + ("" if cfg.include_request else "-noreq"))

    def features(self, items: list[JudgeInput]) -> tuple[list[str], list[str], list[torch.Tensor], torch.Tensor]:
        """(roles, next-state texts, MiniLM features ((f,) each), reader features (n, d)) of `items`.
        MiniLM and the reader run at once on two cores (torch ops release the GIL), each in one
        batched call for all the items: a batch costs the slower of the two, not their sum."""
        roles, texts = [item_role(i) for i in items], [state_text(i) for i in items]
        threads, before = self.cfg.embedded.threads, torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)  # both encoders set the same count: no restore races
        try:
            read = _POOL.submit(self.reader.features_batch, roles, texts)
            x = items_features(self.encoder, self.exemplars, self.exemplar_emb, items, self.cfg.include_request)
            return roles, texts, x, read.result()
        finally:
            torch.set_num_threads(before)

    def judge_batch(self, items: list[JudgeInput]) -> list[Judgment]:
        """Judgments of several turns at the cost of one batched pass (`judge_many` uses it)."""
        if not items:
            return []
        roles, texts, x, rx = self.features(items)
        out = []
        for i, item in enumerate(items):
            probs = stacked_probs(self.probes[roles[i]], self.heads[roles[i]], x[i][None], rx[i:i + 1])[0]
            score = CLASSES[int(probs.argmax())]
            p = [round(float(v), 3) for v in probs]
            hint = None
            wants = self.cfg.hints == "always" or (self.cfg.hints == "nonzero" and score != 0)
            if wants and item.next_role != "tool":
                hint = extract_hint(texts[i], self.cfg.hint_min_chars)
            why = f"p(-1,0,+1)={tuple(p)} from the {item.next_role} next state"
            out.append(Judgment(score, [score], why, hint, self.name, {"probs": p}, self.version))
        return out

    async def __call__(self, item: JudgeInput) -> Judgment:
        return self.judge_batch([item])[0]


def item_role(item: JudgeInput) -> str:
    return "tool" if item.next_role == "tool" else "user"


def item_features(encoder: MiniLM, exemplars: dict[str, list[dict]], exemplar_emb: dict[str, torch.Tensor],
                  item: JudgeInput, include_request: bool = True) -> tuple[str, str, torch.Tensor]:
    """(role, next-state text, (1, f) features) of one turn."""
    x = items_features(encoder, exemplars, exemplar_emb, [item], include_request)[0]
    return item_role(item), state_text(item), x[None]


def items_features(encoder: MiniLM, exemplars: dict[str, list[dict]], exemplar_emb: dict[str, torch.Tensor],
                   items: list[JudgeInput], include_request: bool = True) -> list[torch.Tensor]:
    """The (f,) MiniLM features of each item (f depends on the role), one encoder call for all."""
    texts, spans = [], []
    for item in items:
        parts = clauses(state_text(item))
        request = request_text(item)[:GIST_CHARS] if include_request else ""
        spans.append((len(texts), len(parts)))
        texts += parts + [request, reply_text(item)[:GIST_CHARS]]
    emb = encoder.embed(texts)
    rows = []
    for item, (at, k) in zip(items, spans):
        role, e = item_role(item), emb[at:at + k + 2]
        rows.append(feature_vector(role, state_text(item), e[:k], exemplar_emb[role],
                                   [x["label"] for x in exemplars[role]], e[k] if include_request else None, e[k + 1]))
    return [torch.tensor(r) for r in rows]


def _head(tensors: dict[str, torch.Tensor], prefix: str) -> Head:
    return Head(*(tensors[f"{prefix}.{k}"] for k in ("weight", "bias", "mean", "std")))


def _load_head(path: Path, digest: str) -> dict[str, torch.Tensor] | None:
    from safetensors import safe_open

    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("data_sha256") != digest:
            return None
        names = list(f.keys())  # noqa: SIM118 - a safetensors handle is not iterable
        return {k: f.get_tensor(k) for k in names}


def train_rows(encoder: MiniLM, reader: Reader, exemplars: dict[str, list[dict]], emb: dict[str, torch.Tensor],
               labelled: Path, batch: int = 16) -> list[tuple[str, str, torch.Tensor, torch.Tensor, int]]:
    """(id, role, MiniLM features, reader features, label) of each train item, in file order. Both
    encoders run batched (texts of similar length together for the reader, so little padding)."""
    items = load_labelled(labelled, "train")
    x: list[torch.Tensor] = []
    for at in range(0, len(items), batch):
        x += items_features(encoder, exemplars, emb, [i.input for i in items[at:at + batch]])
    roles, texts = [item_role(i.input) for i in items], [state_text(i.input) for i in items]
    order = sorted(range(len(items)), key=lambda i: len(texts[i]))
    rx: list[torch.Tensor | None] = [None] * len(items)
    for at in range(0, len(order), batch):
        idx = order[at:at + batch]
        for i, f in zip(idx, reader.features_batch([roles[i] for i in idx], [texts[i] for i in idx])):
            rx[i] = f
    return [(i.id, roles[n], x[n], rx[n], i.label) for n, i in enumerate(items)]


def fit_role(rows: list, role: str) -> tuple[Head, Head]:
    mine = [r for r in rows if r[1] == role]
    return fit_stacked(torch.stack([r[2] for r in mine]), torch.stack([r[3] for r in mine]), [r[4] for r in mine],
                       L2, L2_READER, STACK_FOLDS)


def build_tensors(encoder: MiniLM, reader: Reader, exemplars: dict[str, list[dict]],
                  labelled: Path) -> dict[str, torch.Tensor]:
    """Embed the exemplars and fit the stacked heads per role on the labelled train split."""
    emb = {r: encoder.embed([e["text"] for e in exemplars[r]]) for r in ROLES}
    rows = train_rows(encoder, reader, exemplars, emb, labelled)
    out = {f"{r}.exemplars": emb[r] for r in ROLES}
    for r in ROLES:
        probe, head = fit_role(rows, r)
        for prefix, h in ((r, head), (f"{r}.reader", probe)):
            out.update({f"{prefix}.weight": h.weight, f"{prefix}.bias": h.bias, f"{prefix}.mean": h.mean,
                        f"{prefix}.std": h.std})
    return out


def build(cfg: JudgeConfig | None = None) -> Path:
    """Rebuild the shipped head file from configs/judge/ (run after editing the data)."""
    from safetensors.torch import save_file

    cfg = cfg or JudgeConfig()
    head_path, exemplars_path, labelled_path = _paths(cfg)
    exemplars = {r: [e for e in _read_exemplars(exemplars_path) if e["role"] == r] for r in ROLES}
    tensors = build_tensors(shared_encoder(), shared_reader(cfg), exemplars, labelled_path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(head_path),
              metadata={"data_sha256": data_hash(exemplars_path, labelled_path, cfg), "model": MODEL_ID,
                        "reader": f"{cfg.embedded.reader.name}:{cfg.embedded.reader_layers}:int8={cfg.embedded.reader_int8}",
                        "features_version": FEATURES_VERSION, "l2": str(L2), "l2_reader": str(L2_READER)})
    head_path.chmod(0o644)
    return head_path


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        sys.exit("usage: python -m clawflow.judge.embedded build")
    print(build())
