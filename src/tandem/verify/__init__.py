"""Verification rules: pure tensor functions, no model and no state."""
