"""LoRA adapters: PEFT checkpoints read (``checkpoint.py``), registered and paged into a device
slot pool (``manager.py``), and a step's rows grouped by slot for the kernels (``segments.py``)."""
