"""The prompt batch and sizes shared by engine tests and the multi-process worker.

No imports: the worker reads it before ``jax.distributed`` starts.
"""

MAX_BATCH = 8
MAX_SEQ_LEN = 64
NEW_TOKENS = 16
# Prompts of different lengths (one row of the batch stays a padding row).
PROMPTS = [
    [5, 17, 99, 3, 250, 7, 31],
    [42, 8],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
    [200],
    [77, 66, 55, 44],
    [9, 19, 29, 39, 49, 59, 69, 79, 89, 99],
    [128, 64, 32],
]
