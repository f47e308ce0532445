"""foldtune planner package."""
