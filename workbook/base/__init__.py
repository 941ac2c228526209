"""The ground: the project's error type and human units for display. Imports nothing of the
workbook."""
