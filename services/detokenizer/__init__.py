"""The detokenizer stage: incremental decoding (incremental.py), per-step batches to text
(batches.py), and the process loop (process.py)."""
