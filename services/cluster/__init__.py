"""Launching a whole pdserve cluster as local processes (`pdserve up`)."""
