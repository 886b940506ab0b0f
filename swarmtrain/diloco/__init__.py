"""pure torch, no I/O: snapshot, pseudo-gradient, outer Nesterov step, the DiLoCo worker loop."""
