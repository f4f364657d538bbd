"""The `kvstack` command line: one module per subcommand, shared flags in `args`."""
