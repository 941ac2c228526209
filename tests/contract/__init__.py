"""Tests of workbook/contract/: the task contract, the target kinds, the framework adapters
and the data."""
