"""The SQLite ledger: schema and named migrations, one writer thread, read connections.

ledger = LedgerWriter.open(path, synchronous="full", batch_max=1024, busy_timeout_s=5.0)
fut = ledger.record_turn(turn)   # Future: resolves after the commit (acknowledged)
conn = open_reader(path)         # read-only sqlite3 connection, never blocks the writer
"""

from appliance.ledger.aio import AsyncLedger, acknowledged
from appliance.ledger.connections import open_reader
from appliance.ledger.writer import LedgerWriter

__all__ = ["AsyncLedger", "LedgerWriter", "acknowledged", "open_reader"]
