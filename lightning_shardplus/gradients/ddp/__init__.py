"""DDP's gradient side (``side.py``): communication hooks (``compression.py``), the bucket size and its tuning
(``fusion.py``), the steps around DDP's forward (``steps.py``) and the DDP strategy's options (``config.py``)."""
