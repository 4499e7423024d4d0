"""`python -m eval ...`: the lm-eval CLI (same subcommands and flags as `lm-eval`) with the
`looped` model registered, the local tasks (eval/tasks) on the include path, and the per-task
exit depths added to the results table and JSON.

    python -m eval run --model looped --model_args pretrained=checkpoints/ouro-demo,exit_threshold=0.7 \\
        --tasks looped_suite --limit 50 --output_path results/

When every requested task is a local one, lm-eval's ~16 s index of its built-in tasks is skipped;
standard tasks (arc_easy, hellaswag, gsm8k, ...) work unchanged for users with internet.
"""
from __future__ import annotations

import sys
from pathlib import Path

import lm_eval
import lm_eval.tasks
from lm_eval._cli import HarnessCLI
from lm_eval.tasks import TaskManager
from lm_eval.utils import setup_logging

from eval import lm as looped  # registers the model "looped"


def _local_task_names() -> set[str]:
    return set(TaskManager(include_path=str(looped.TASKS_DIR), include_defaults=False).all_tasks)


def _local_only(tasks: list[str] | str | None) -> bool:
    if not tasks:
        return False
    names = [t for task in ([tasks] if isinstance(tasks, str) else tasks) for t in task.split(",") if t]
    local = _local_task_names()
    return all(n in local or Path(n).exists() for n in names)


def main(argv: list[str] | None = None) -> None:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    setup_logging()
    lm_eval.simple_evaluate = looped.simple_evaluate  # the CLI imports it from lm_eval at run time
    cli = HarnessCLI()
    args = cli.parse_args()
    if getattr(args, "command", None) in ("run", "ls", "validate"):
        include = [str(looped.TASKS_DIR)]
        if getattr(args, "include_path", None):
            include.append(args.include_path)
        local = args.command == "run" and _local_only(getattr(args, "tasks", None))

        class Manager(TaskManager):  # lm-eval builds its TaskManager from the parsed flags
            def __init__(self, *a, include_path=None, include_defaults: bool = True, **kw):
                super().__init__(*a, include_path=include, include_defaults=include_defaults and not local, **kw)

        lm_eval.tasks.TaskManager = Manager
    cli.execute(args)


if __name__ == "__main__":
    from looplm.cli import run

    run(main)
