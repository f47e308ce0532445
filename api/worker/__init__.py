"""The worker (``foldtune runner``): claims queued jobs and trainings and runs them through the Ray launcher."""
