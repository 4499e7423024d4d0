"""`python -m infer.bench`: the offline benchmark (offline.py)."""
from looplm.cli import run

from .offline import main

run(main)
