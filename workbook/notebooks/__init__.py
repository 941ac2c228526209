"""One entry module per notebook capability (01 inspection ... 09 parallel) and their figures.

Each has `run(params, out) -> result` and `save(result, out) -> verdict`; a notebook with parts
is a family package (`gates/`, `rental/`, ...) whose `__init__` is that module, its parts (and
the body of any new process it starts, `process`) beside it. `registry` holds one entry per
notebook (stem, title, key figures, its verdict's reason, its module). They may import training,
contract, storage and base, never commands.
"""
