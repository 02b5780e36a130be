"""The ground floor below every other package: what all of them share and that imports nothing (the
error root)."""
