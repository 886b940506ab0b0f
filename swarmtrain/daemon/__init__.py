"""the thin CLI: cli.py dispatches to one cmd_*.py module per subcommand.

signals.py   StopSignals: a daemon's first SIGTERM/SIGINT stops it, a second exits at once
children.py  `swarmtrain` child processes for the demo and the tests
"""
