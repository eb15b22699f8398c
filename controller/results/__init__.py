"""Getting results back and the box down: what is sealed, verified pulls, receipts, and the
gated teardown (``rgt down`` beside ``rgt pull``, not above it)."""
