"""The data side both strategies share, over the DATA-PARALLEL ranks (``group.py``): sampling and the permutation,
loaders, the DataModule, uneven streams, aggregation windows, exact evaluation, epoch values and the averaged
training metrics. It imports no gradient side."""
