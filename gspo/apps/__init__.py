"""The front-ends: the `gspo` command (cli.py), the Python API (api.py: Trainer, GRPOTrainer, GSPOTrainer),
the benchmark (bench.py), the demos (demo.py, demo_real.py, demo_tools.py) and the stability lab (lab/,
behind the `lab` extra). They use the library; nothing in the library imports them."""
