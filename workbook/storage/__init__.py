"""Storage: run folders, files written atomically and read back through schemas, the SQLite
ledger, record dataclasses. Imports base only."""
