"""The tokenizer stage: chat templates and preprocessing (preprocess.py), and the worker process loop (process.py)."""
