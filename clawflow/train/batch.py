"""The training batch: samples read from a Parquet file, collated into padded tensors.

A sample (clawflow/contracts/sample.py) is one assistant turn with its judgment: the prompt token
ids, the response token ids and their logprobs exactly as the engine sampled them, the reward, and
(for OPD) a hindsight hint plus the request's messages for the hint-augmented teacher prompt.

Layout after `collate` (clawflow/policy/logprobs.py; prompts left-padded, responses right-padded, so every response starts at
the same column and the model only needs logits for the last R + 1 positions):

    input_ids      x  p0 p1 p2 r0 r1 x       [B, L]   L = P_max + R_max
    position_ids   0  0  1  2  3  4  4       [B, L]   counts real tokens only
    targets                 r0 r1 x          [B, R]   logits at columns P_max-1 .. L-2 predict these
    mask                    1  1  0          [B, R]   response tokens
    rollout                 l0 l1 0          [B, R]   logprobs recorded by the engine
"""

from __future__ import annotations

# The sample file's one schema, record and reader live with the writer's (clawflow/contracts/sample.py);
# `collate` with the one reply scorer, which serving shares (clawflow/policy/logprobs.py).
from clawflow.contracts.sample import OPTIONAL, REQUIRED, Sample, read_samples  # noqa: F401 - re-exported
from clawflow.policy.logprobs import collate  # noqa: F401 - re-exported for the trainer

load_samples = read_samples  # the trainer's name for the contract's reader


