"""The operator console (Textual). It talks to the daemon over HTTP only."""
