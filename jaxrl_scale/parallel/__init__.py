"""Where arrays live: the device mesh and its logical-axis rules (sharding.py), and the
multi-controller runtime across processes (distributed.py). Imports only the configuration."""
