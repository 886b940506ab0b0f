"""the thin CLI: cli.py dispatches to one cmd_*.py module per subcommand.

config_reference.py  `swarmtrain config reference`: docs/configuration.md from the config's field docs

Signals and child processes are in swarmtrain/process.
"""
