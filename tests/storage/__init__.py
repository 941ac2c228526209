"""Tests of workbook/storage/: run folders, files, schemas and the ledger."""
