"""The thin CLI: cli.py dispatches to one cmd_*.py module per subcommand.

cmd_*.py     one subcommand each (cmd_peer.py is `swarmtrain peer`, cmd_simulate.py `swarmtrain simulate`, ...)
options.py   the shared options: `--config run.toml` and repeated `--set section.key=value`
demo_pipeline.py  `swarmtrain demo --pipeline`: a pipeline swarm on 127.0.0.1
config_reference.py  `swarmtrain config reference`: docs/configuration.md from the config's field docs

Signals and child processes are in swarmtrain/process.
"""
