"""The shapes a turn takes between stages that are persisted as Parquet, each defined once.

Each module holds one contract: a typed record, its Arrow schema (column names and types are the
file format: existing files must keep reading), and its one writer and reader, used by both the
stage that writes and the stages that read.

- turn.py: the turn record, as the gateway writes it (WAL, then Parquet shards), with its
  versioned schema and the upgrade path of older shards
- pair.py: a main turn with its next state (catalog → judge → sample builder), in memory only
- judgment.py: the judge's row, `judgments/*.parquet`; and `Judged`, that row as the training
  flow carries it (plus the reward the turn trains with)
- sample.py: the training sample (orchestrator → trainer), `runs/<run_id>/samples.parquet`
- env_reward.py: an environment's outcome for a turn, `env_rewards/*.parquet`

Ground floor: these import only clawflow.home, never a stage's package; the storage root they
read and write is a Protocol (_parquet.Root).
"""

from clawflow.contracts.env_reward import EnvReward, read_env_rewards, write_env_rewards
from clawflow.contracts.judgment import Judged, JudgmentRow, read_judgments, write_judgments
from clawflow.contracts.pair import Pair
from clawflow.contracts.sample import Sample, read_samples, write_samples

__all__ = ["EnvReward", "Judged", "JudgmentRow", "Pair", "Sample", "read_env_rewards", "read_judgments", "read_samples",
           "write_env_rewards", "write_judgments", "write_samples"]
