"""Tests of workbook/training/: the loop, evaluation, memory counters, predictions and sharding."""
