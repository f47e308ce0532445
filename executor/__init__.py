"""foldtune executor package."""
