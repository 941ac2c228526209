"""Commands: `python -m workbook ...`, the pilot that runs the notebooks, their parameters and
the report.

The top layer: it may import every layer below (notebooks, training, contract, storage, base).
"""
