"""Features of the embedded judge: what the next state says, as a dozen numbers.

Pure functions over unit-vector embeddings and text, so they are testable without the model.
Per role (user / tool) the vector is:
- per class (−1, 0, +1): the highest cosine between any clause of the next state and that
  class's exemplars (a "that's wrong" clause inside a long message still counts), and the mean of
  the whole message's three nearest exemplars of that class;
- cosine of the next state to the request (a rephrased request is a redo) and to the reply;
- lexical cues the encoder is weak at: corrections vs plain negation, "I said/asked", approval,
  questions, follow-ups ("and …?", "btw"), sarcasm, "but"; error, structured-failure, success and
  empty-result patterns in tool output.
Topic words dominate a sentence embedding; comparing clauses with short topic-free exemplars is
what makes the signal about feedback instead of about bananas or SQL.
"""

from __future__ import annotations

import re

CLASSES = (-1, 0, 1)

_SPLIT = re.compile(r"(?<=[.!?;])\s+|\n+|,\s+(?=but\b|though\b|however\b)|\s+-\s+", re.IGNORECASE)
_I = re.IGNORECASE
# Chosen by 5-fold cross-validation on the train split (bench/judge_cv.py); the order is the
# feature order, so a change here means FEATURES_VERSION + 1 in embedded.py and a rebuild.
_CUES = {
    "user": [
        # an explicit correction
        re.compile(r"\b(no|nope|wrong|incorrect|not (what|right|it|quite)|instead|forgot|missed|ignored|worse|useless|"
                   r"terrible|doesn't work|didn't work|still (broken|wrong|fails?|not))\b", _I),
        # any negation (weaker: "we haven't decided yet" is not a correction)
        re.compile(r"\b(not|never|still|again)\b|n't\b", _I),
        # what should have been done
        re.compile(r"\b(i (said|asked|meant|wanted|told you|already|need(ed)?)|please|pls|make it|should|too (long|short|"
                   r"formal|casual|vague|much|many)|next time|i prefer|way (over|too)|did you (even )?read)\b", _I),
        # approval
        re.compile(r"\b(thanks?|thank you|thx|ty|cheers|perfect|great|awesome|nice|neat|love|loved|works|worked|fixed|"
                   r"exactly|cool|good|helps?|helpful|brilliant|lovely|beautiful|yes|yep|yeah|sold|nailed|saved|lifesaver|"
                   r"spot on|makes sense|til|go ahead|going with|haha|lol|clear|merged|did it)\b|"
                   r"[🙏👍😀😂😄🎉❤😍👌🔥😎🤯🙌]", _I),
        re.compile(r"\?\s*$"),
        # a follow-up or a new topic, not feedback
        re.compile(r"^\s*(and|what about|how about|also|btw|by the way|unrelated|separately|off topic|"
                   r"different question)\b", _I),
        # sarcasm
        re.compile(r"\b(thanks for nothing|not\.|oh (great|fantastic|brilliant|wonderful|sure)|great,? another|"
                   r"did you even|yeah,? (right|sure)|wow,? (so|really|super)|super helpful\.|\.\.\.\s*sure)\b", _I),
        # mixed signals
        re.compile(r"\b(but|though|however|although)\b", _I),
    ],
    "tool": [
        re.compile(r"traceback|\berror\b|exception|\bfailed\b|failure|fatal|denied|not found|no such|refused|"
                   r"timed? ?out|cannot|can't|could not|unable|invalid|rejected|segmentation fault|killed|panic|"
                   r"\b[45]\d\d\b (?!ms)|(?<!\b0% )packet loss|ERR!|unauthori[sz]ed|not resolve|reset by peer|"
                   r"exit (code|status) [1-9]|non-?zero (code|exit|status)|\bFAIL\b|[✕✗✘❌]|crashloopbackoff|"
                   r"imagepullbackoff|errimagepull|oomkilled|\bevicted\b|\bbroken\b|undefined:|no rule to make|"
                   r"\bCONFLICT\b|\babort(ed|ing)?\b|command not found|\bunmet\b", _I),
        # a structured failure
        re.compile(r"\"(status|state)\": \"(error|failed|failure)\"|\"(confirmed|success|ok)\": false|\"error\":", _I),
        re.compile(r"\b0 (errors?|failed|issues)\b|no issues|all checks passed|\bpassed\b|succe(ss|eded)|successfully|"
                   r"\b200 OK\b|HTTP/[\d.]+ 200|\b0% packet loss|\bfinished\b|\bdone\b|\"(confirmed|success|ok)\": true|"
                   r"\"status\": \"(sent|created|ok|done|success)\"", _I),
        # an empty result
        re.compile(r"^\s*(\[\]|\{\}|\(0 rows\)|null)\s*$|\bno (results|tests ran|matches)|nothing to|: \[\]|"
                   r"\"(total|count)\": 0\b", _I),
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
