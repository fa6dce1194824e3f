"""Screens of the console: one per tab, the session detail and the dialogs."""
