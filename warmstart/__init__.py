"""warmstart."""
