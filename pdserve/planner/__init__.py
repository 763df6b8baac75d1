"""Which phase limits a deployment, and how to split devices: step-time profiles, a simulator
that drives the real scheduling code, and a planner that ranks deployments (no torch)."""
