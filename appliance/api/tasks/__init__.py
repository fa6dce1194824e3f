"""The task routes and the Idempotency-Key replay that guards their changes."""
