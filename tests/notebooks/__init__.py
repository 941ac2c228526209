"""Tests of workbook/notebooks/: one file per notebook capability (01-09), each with its
planted bugs and clean twins."""
