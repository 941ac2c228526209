"""One module per notebook capability (01 inspection ... 09 parallel) and their figures.

Each has `run(params, out) -> result` and `save(result, out) -> verdict`; it may import
training, contract, storage and base, never commands.
"""
