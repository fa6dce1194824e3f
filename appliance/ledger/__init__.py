"""The SQLite ledger: schema and named migrations, one writer thread, read connections."""
