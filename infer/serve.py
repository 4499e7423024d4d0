"""`python -m infer.serve`: the OpenAI-compatible server (infer/serving/cli.py); `--device emulated:h100`
serves on the emulated device (infer/bench/emulated.py)."""
from infer.serving.cli import main


def emulate(a):
    """The engine on an emulated device (imported only when one is asked for)."""
    from infer.bench.emulated import engine_from_args
    return engine_from_args(a)


if __name__ == "__main__":
    from looplm.cli import run

    run(lambda: main(emulate=emulate))
