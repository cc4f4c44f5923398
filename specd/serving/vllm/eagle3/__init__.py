"""The `eagle3` route: vLLM's own EAGLE-3 proposer serves specd's feature drafter; `plugin` attaches
the `companion` (records, in-place swaps) in vLLM's workers; `hybrid_rows` mixes context matching
into EAGLE-3's drafts per row."""
