"""Storage: run folders, the child processes a command starts (their outcome handed back in a
file), files written atomically and read back through schemas, the SQLite ledger, record
dataclasses. Imports base only."""
