"""Standing preferences: what a user asked for, kept, and distilled by every later training run.

A correction's hindsight hint trained one run and was gone (issue #27): "30 words at most", said in
round 1, was not in round 3's data. Here the concrete hints of turns judged −1 become durable
records, keyed by user: merged when they say the same thing, superseded when a later one
contradicts an earlier one ("shorter" then "more detail": the later wins), never made from vague
("that's wrong") or content corrections ("no, Paris"), and forgettable.

- `axes.py`: which standing preference a hint states, if any (pure);
- `record.py`: the record and its Parquet form;
- `update.py`: folding a run's hints into a user's preferences (pure);
- `store.py`: the file under the storage root, the lock, `forget`.
"""
