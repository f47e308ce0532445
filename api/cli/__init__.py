"""The ``foldtune`` command line: one module per subcommand, dispatched by :mod:`api.cli.main`."""
