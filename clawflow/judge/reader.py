"""The embedded judge's reader: how a small chat LM reads the next state.

MiniLM is a sentence-similarity model, so topic words dominate its embeddings, and it cannot
tell "wow, super helpful" from "wow, super helpful!" by tone. A chat LM has read millions of
users reacting to assistants. The reader runs the first `layers` of SmolLM2-135M-Instruct (the
default policy's *base* weights, never the trained policy) over `<|im_start|>{role}\n{next state}`
and mean-pools the hidden states of the next state's tokens. A logistic head on those 576 numbers
gives p(−1, 0, +1), which the embedded judge stacks onto its MiniLM features
(`clawflow/judge/stack.py`).

A long tool result is read as its first and last `tool_tokens` tokens: a test run, a build or a
deploy says how it went at the end ("1 failed", "exit code 2", "CrashLoopBackOff"), after a head
that says what ran. User messages are read from the start (`max_tokens`).

Middle layers read best (5-fold CV on the train split, `bench/judge_cv.py`; see configs/judge/README.md).
The final norm is skipped, so the features are the residual stream at layer `layers` itself. Opt-in:
dynamic int8 linears (`judge.embedded.reader_int8`), twice as fast and less accurate.
"""

from __future__ import annotations

from pathlib import Path

from clawflow.judge.minilm import length_batches

READER_VERSION = "2"  # 2: a long tool result is read as its head and tail


def clip_tokens(ids: list[int], role: str, max_tokens: int = 64, tool_tokens: int = 48) -> list[int]:
    """The tokens of a next state that the reader reads: a user message's first `max_tokens`; a
    tool result's first and last `tool_tokens` when it is longer than both (5-fold CV on the train
    split, tool items: 0.89 for the first 64 tokens, 0.916 for 48 + 48, 0.918 for 64 + 64)."""
    if role == "tool":
        return ids if len(ids) <= 2 * tool_tokens else ids[:tool_tokens] + ids[-tool_tokens:]
    return ids[:max_tokens]


class Reader:
    def __init__(self, model_dir: str | Path, layers: int = 14, max_tokens: int = 64, threads: int | None = 1,
                 int8: bool = False, tool_tokens: int = 48):
        import torch
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        from clawflow.policy.loader import load_policy

        hf_logging.disable_progress_bar()
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        lm = load_policy(model_dir, torch.float32).eval()
        if layers < 1 or layers > len(lm.model.layers):
            raise ValueError(f"reader layers must be 1..{len(lm.model.layers)}, not {layers}")
        self.model = lm.model  # the decoder alone: no lm_head, no logits
        self.model.layers = self.model.layers[:layers]
        self.model.norm = torch.nn.Identity()
        if int8:
            # Twice as fast per turn (31 vs 63 ms at 14 layers, 1 thread), but CV accuracy drops (0.855
            # vs 0.883 on the 797 train items): opt-in. The head is fitted on whatever features the reader gives.
            self.model = torch.ao.quantization.quantize_dynamic(self.model, {torch.nn.Linear}, dtype=torch.qint8)
        self.layers, self.max_tokens, self.tool_tokens, self.threads = layers, max_tokens, tool_tokens, threads
        self._end = self.tokenizer("<|im_end|>")["input_ids"]

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def tokens(self, role: str, text: str) -> tuple[list[int], tuple[int, int]]:
        """(input ids, the span of the next state's tokens in them): what the reader reads."""
        prefix = self.tokenizer(f"<|im_start|>{role}\n")["input_ids"]
        body = clip_tokens(self.tokenizer(text)["input_ids"], role, self.max_tokens, self.tool_tokens)
        ids = prefix + body + self._end
        return ids, (len(prefix), len(ids))

    def features(self, role: str, text: str):
        """(hidden,) float32: mean of the layer-`layers` states over the next state's tokens."""
        return self.features_batch([role], [text])[0]

    def features_batch(self, roles: list[str], texts: list[str]):
        """(n, hidden): `features` of several next states in one right-padded forward, so the weights
        are read once for all of them (a causal model never attends to the padding after a row)."""
        torch = self._torch
        rows, spans = zip(*(self.tokens(role, text) for role, text in zip(roles, texts)))
        out = torch.zeros(len(rows), self.dim)
        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            # Similar lengths together: one long tool log padded onto 7 short replies costs more than
            # a second pass over the weights (bench/judge.py, batches of 8).
            for group in length_batches([len(r) for r in rows], len(rows), slack=2.0):
                width = max(len(rows[i]) for i in group)
                ids = torch.zeros(len(group), width, dtype=torch.long)
                mask = torch.zeros(len(group), width, dtype=torch.long)
                for j, i in enumerate(group):
                    ids[j, : len(rows[i])], mask[j, : len(rows[i])] = torch.tensor(rows[i]), 1
                with torch.inference_mode():
                    hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
                for j, i in enumerate(group):
                    out[i] = hidden[j, spans[i][0]:spans[i][1]].mean(0)
        finally:
            torch.set_num_threads(before)
        return out
