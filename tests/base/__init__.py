"""Tests of workbook/base/: errors and display units."""
