"""Features of the embedded judge: what the next state says, as a dozen numbers.

Pure functions over unit-vector embeddings and text, so they are testable without the model.
Per role (user / tool) the vector is:
- per class (−1, 0, +1): the highest cosine between any clause of the next state and that
  class's exemplars (a "that's wrong" clause inside a long message still counts), and the mean of
  the whole message's three nearest exemplars of that class;
- cosine of the next state to the request (a rephrased request is a redo) and to the reply;
- lexical cues the encoder is weak at: negation, "I said/asked", questions, error and success
  patterns in tool output.
Topic words dominate a sentence embedding; comparing clauses with short topic-free exemplars is
what makes the signal about feedback instead of about bananas or SQL.
"""

from __future__ import annotations

import re

CLASSES = (-1, 0, 1)

_SPLIT = re.compile(r"(?<=[.!?;])\s+|\n+|,\s+(?=but\b|though\b|however\b)|\s+-\s+", re.IGNORECASE)
_CUES = {
    "user": [
        re.compile(r"\b(no|nope|not|wrong|incorrect|isn't|doesn't|didn't|don't|can't|never|still|again|instead|"
                   r"forgot|missed|ignored|worse|useless|terrible)\b|n't\b", re.IGNORECASE),
        re.compile(r"\b(i (said|asked|meant|wanted|told you|already)|please|make it|should|too (long|short|formal|"
                   r"casual|vague)|next time|i prefer)\b", re.IGNORECASE),
        re.compile(r"\b(thanks?|thank you|thx|ty|perfect|great|awesome|nice|love|works|worked|fixed|exactly|cool|"
                   r"good|helps?|brilliant|lovely|beautiful)\b|[🙏👍😀😂😄🎉❤😍👌🔥😎🤯]", re.IGNORECASE),
        re.compile(r"\?\s*$"),
        re.compile(r"\b(thanks for nothing|not\.|oh (great|fantastic|brilliant|wonderful)|great,? another|did you even)\b", re.IGNORECASE),
    ],
    "tool": [
        re.compile(r"traceback|\berror\b|exception|\bfailed\b|failure|fatal|denied|not found|no such|refused|timed? ?out|"
                   r"cannot|can't|could not|unable|invalid|rejected|segmentation fault|killed|panic|"
                   r"\b[45]\d\d\b (?!ms)|packet loss|ERR!|unauthori[sz]ed", re.IGNORECASE),
        re.compile(r"\b0 (errors?|failed|issues)\b|no issues|all checks passed|\bpassed\b|succe(ss|eded)|\b200 OK\b|"
                   r"\b0% packet loss", re.IGNORECASE),
        re.compile(r"^\s*(\[\]|\{\}|\(0 rows\)|null)\s*$|\bno (results|tests ran|matches)|nothing to|\"results\": \[\]", re.IGNORECASE),
        re.compile(r"^\s*$"),  # no output: a command that prints nothing on success
    ],
}


def clauses(text: str, limit: int = 8) -> list[str]:
    """The whole text first, then its sentences/clauses (at most `limit` in all)."""
    text = text.strip()
    parts = [p.strip() for p in _SPLIT.split(text) if p and p.strip()]
    extra = [p for p in parts if p != text]
    return ([text] + extra)[:limit] if text else [""]


def cue_flags(role: str, text: str) -> list[float]:
    return [1.0 if rx.search(text) else 0.0 for rx in _CUES[role]]


def n_features(role: str) -> int:
    return 2 * len(CLASSES) + 2 + len(_CUES[role])


def feature_vector(role: str, text: str, clause_emb, exemplar_emb, exemplar_labels: list[int],
                   request_emb=None, reply_emb=None) -> list[float]:
    """`clause_emb`: (k, d) embeddings of `clauses(text)` (row 0 = whole text); `exemplar_emb`:
    (n, d) of this role's exemplars with `exemplar_labels`; request/reply: (d,) or None."""
    sims = clause_emb @ exemplar_emb.T  # (k, n)
    out: list[float] = []
    for c in CLASSES:
        cols = [i for i, y in enumerate(exemplar_labels) if y == c]
        block = sims[:, cols]
        out.append(float(block.max()))
        out.append(float(block[0].topk(min(3, len(cols))).values.mean()))
    whole = clause_emb[0]
    out.append(float(whole @ request_emb) if request_emb is not None else 0.0)
    out.append(float(whole @ reply_emb) if reply_emb is not None else 0.0)
    return out + cue_flags(role, text)
