from looplm.cli import run

from .offline import main

run(main)
