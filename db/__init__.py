"""foldtune db package."""
