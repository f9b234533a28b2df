"""Averaged training metrics: each optimizer step's logged values, as the mean over the data-parallel ranks, in one
collective in the steps something reads (``readers.py``)."""
