"""Widgets of the console: the virtual table, bars, panels and the frame."""
