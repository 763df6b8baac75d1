"""Engine worker pools: starting, watching and restarting the processes that run the engine."""
