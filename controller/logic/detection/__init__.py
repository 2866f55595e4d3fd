"""Detection logic (C4D-style findings, straggler causes) over plain data."""
