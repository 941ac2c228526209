"""Tests of workbook/commands/: the commands: the pilot, the CLI, parameters, the report."""
