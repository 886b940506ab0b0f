"""Operating-system processes, below every role that starts or stops one (peer, pipeline, testbed, daemon);
a process's descendants (read from /proc, signalled and awaited through pidfds) are swarmtrain/proctree.py.

signals.py   StopSignals: a daemon's first SIGTERM/SIGINT stops it, a second exits at once
children.py  `swarmtrain` child processes for the demo, the testbed and the tests (READY lines, deadlines, kill)
"""
