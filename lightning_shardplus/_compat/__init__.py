"""The one door to what shardplus does not own: every private Lightning and torch name (``lightning.py``,
``torch.py``, each guarded by a canary test), the two-namespace mechanism (``namespace.py``) and Lightning's
warnings that are false under shardplus (``warnings.py``)."""
