"""foldtune api package."""
