"""The Lightning strategies: the data side's overrides (``data_side.py``), DDP's strategy (``ddp.py``), the
model-parallel strategy (``model_parallel.py``) and the table of registered names (``registry.py``)."""
