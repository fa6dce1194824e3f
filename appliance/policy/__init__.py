"""Pure, synchronous decisions: no I/O, no clock (the caller passes `now`), no logging."""
