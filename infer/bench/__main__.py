from looplm.cli import run

from .emulated import bench_emulated
from .offline import main

run(lambda: main(emulate=bench_emulated))
