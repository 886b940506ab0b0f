"""the thin CLI: cli.py dispatches to one cmd_*.py module per subcommand."""
