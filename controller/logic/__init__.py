"""Pure decision logic: no I/O, no database, no event loop; testable with plain data."""
