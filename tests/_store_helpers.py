"""Reading the catalog's pending pairs in tests without claiming them."""

from clawflow.contracts.pair import Pair
from clawflow.store import queries


def pending_pairs(cat, limit: int) -> list[Pair]:
    """Unconsumed, unclaimed main turns with their next state (`next_state`, `next_role`), oldest
    first: the query `Catalog.select_batch` runs, read without claiming anything."""
    if limit <= 0:
        return []
    with cat.connect() as con:
        return queries.batch(cat, con, max_turns=limit)
