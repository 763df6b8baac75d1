"""Native kernels pdserve builds for the machine it runs on (see `build.py`)."""
