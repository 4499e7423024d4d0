"""What every train/ script does around its main(): one-line errors, the launch check, the
parent-death guard, the start banner, and the output-folder contract (reuse / finished / cleanup).

- `run(main)`: a `UserError` (or any exception) prints `error: <message>` on one line and exits
  non-zero; the traceback only with `--debug` or env `LOOPLM_DEBUG=1`. Under a multi-rank launch
  only rank 0 prints a user mistake (the others exit with the same code quietly, a little later);
  other failures are printed by each rank that meets them.
- `check_launch(acc)`: `accelerate launch --cpu --num_processes 2` starts ONE process (accelerate's
  simple launcher ignores --num_processes; it only sets MASTER_ADDR/MASTER_PORT). The launcher's
  command line (/proc/PPID/cmdline) and config file say how many ranks were asked for; fewer
  started ranks is an error that names the command that works.
- `die_with_launcher()`: launched workers get SIGTERM when the launcher dies (Linux
  prctl(PR_SET_PDEATHSIG)) plus a watchdog thread that exits when the parent pid changes (other
  systems, and the window before prctl). Plain `python script.py` runs (e.g. under nohup) are not
  armed.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from looplm.cli import UserError, debug_enabled, one_line  # the one-line error rules every CLI shares

TWO_CPU_RANKS = ("ACCELERATE_USE_CPU=true accelerate launch --config_file train/configs/cpu_2ranks.yaml SCRIPT ... "
                 "(or: ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N --num_machines 1 "
                 "--mixed_precision no --dynamo_backend no SCRIPT ...)")


def rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


def run(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Call main(argv); turn failures into one `error:` line and a non-zero exit code."""
    debug = debug_enabled(argv)
    if argv is None and "--debug" in sys.argv:
        sys.argv.remove("--debug")  # read here; scripts without a --debug flag of their own accept it too
    try:
        main(argv)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.exit(130)
    except BaseException as e:  # noqa: BLE001 - the point is to catch everything
        if debug:
            traceback.print_exc()
        msg, user = one_line(e, debug)
        if rank() == 0:
            print(f"error: {msg}", file=sys.stderr, flush=True)
        elif not user:  # a rank-specific failure: say which rank
            print(f"error: [rank {rank()}] {msg}", file=sys.stderr, flush=True)
        else:
            # every rank meets a user mistake alike and rank 0 reports it; give it time to, before
            # the launcher sees this rank fail and terminates the others
            time.sleep(3)
        sys.stdout.flush()
        os._exit(2 if user else 1)  # no atexit hooks: a half-started process group must not hang the exit


# ------------------------------------------------------------------------------ the launcher
def parent_cmdline(pid: int | None = None) -> list[str]:
    try:
        raw = Path(f"/proc/{pid or os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [x.decode(errors="replace") for x in raw.split(b"\0") if x]


def _is_accelerate_launch(cmd: list[str]) -> bool:
    text = " ".join(cmd)
    return ("accelerate" in text and "launch" in cmd) or "accelerate.commands.launch" in text


def _is_launcher(cmd: list[str]) -> bool:
    text = " ".join(cmd)
    return _is_accelerate_launch(cmd) or "torchrun" in text or "torch.distributed.run" in text


def _opt(cmd: list[str], *names: str) -> str | None:
    for i, tok in enumerate(cmd):
        for n in names:
            if tok == n and i + 1 < len(cmd):
                return cmd[i + 1]
            if tok.startswith(n + "="):
                return tok.split("=", 1)[1]
    return None


def _launch_args_and_config(cmd: list[str]) -> tuple[list[str], dict | None]:
    """An `accelerate launch` command line's own arguments (before the script) and its config file
    (else accelerate's default config file) as a dict; None when there is none or it is unreadable."""
    try:
        script_at = next(i for i, t in enumerate(cmd) if t.endswith(".py") and "accelerate" not in t)
    except StopIteration:
        script_at = len(cmd)
    launch_args = cmd[:script_at]
    cfg = _opt(launch_args, "--config_file", "--config-file")
    if cfg is None:
        home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
        for name in ("default_config.yaml", "default_config.json"):
            p = Path(os.environ.get("ACCELERATE_CONFIG_FILE", Path(home) / "accelerate" / name))
            if p.exists():
                cfg = str(p)
                break
    if cfg is None:
        return launch_args, None
    try:
        import yaml
        d = yaml.safe_load(Path(cfg).read_text()) if not cfg.endswith(".json") else json.loads(Path(cfg).read_text())
        return launch_args, d if isinstance(d, dict) else None
    except Exception:  # noqa: BLE001 - unreadable config: unknown
        return launch_args, None


def requested_processes(cmd: list[str] | None = None) -> int | None:
    """How many processes an `accelerate launch` command line asked for (flag, else its config
    file, else accelerate's default config file); None when unknown or not an accelerate launch."""
    cmd = parent_cmdline() if cmd is None else cmd
    if not _is_accelerate_launch(cmd):
        return None
    launch_args, cfg = _launch_args_and_config(cmd)
    n = _opt(launch_args, "--num_processes", "--num-processes")
    if n is None and cfg is not None:
        n = cfg.get("num_processes", 1)
    try:
        return int(n) if n is not None else None
    except (TypeError, ValueError):
        return None


def launcher_mixed_precision(cmd: list[str] | None = None) -> str | None:
    """The mixed precision the launch chose (its --mixed_precision flag or config file); None when it
    chose none: `accelerate launch` then sets ACCELERATE_MIXED_PRECISION=no by default, which is not a
    choice. Another launcher (torchrun) with ACCELERATE_MIXED_PRECISION set: that value."""
    cmd = parent_cmdline() if cmd is None else cmd
    if _is_accelerate_launch(cmd):
        launch_args, cfg = _launch_args_and_config(cmd)
        v = _opt(launch_args, "--mixed_precision", "--mixed-precision")
        return v if v is not None else (str(cfg["mixed_precision"]) if cfg and cfg.get("mixed_precision") else None)
    return os.environ.get("ACCELERATE_MIXED_PRECISION") or None


def check_launch(acc, script: str) -> None:
    """Fail when the launch asked for more ranks than started (see the module docstring)."""
    started = acc.num_processes
    cmd = parent_cmdline()
    asked = requested_processes(cmd)
    if asked is None and "WORLD_SIZE" not in os.environ and os.environ.get("MASTER_ADDR") \
            and "ACCELERATE_DYNAMO_BACKEND" in os.environ and not cmd:
        asked = 2  # accelerate's simple launcher sets MASTER_ADDR only when asked for > 1 process
    if asked is not None and asked > started:
        form = " ".join(shlex.quote(c) for c in cmd[:8]) if cmd else "accelerate launch --num_processes N"
        raise UserError(
            f"the launch asked for {asked} processes but {started} started ({form} ...): with --cpu (or use_cpu in the "
            f"config) accelerate runs its single-process launcher. For {asked} CPU ranks use: "
            + TWO_CPU_RANKS.replace("SCRIPT", script).replace(" N ", f" {asked} "))


def fsdp_on_cpu(acc) -> bool:
    """accelerate 1.x turns an FSDP launch on CPU ranks into plain MULTI_CPU (DDP) without a word:
    AcceleratorState enables FSDP only for the multi-GPU-like distributed types (state.py). When the
    launch asked for FSDP (ACCELERATE_USE_FSDP=true) and the state came out MULTI_CPU, switch the
    state to FSDP with the launch's FSDP plugin, so prepare / get_state_dict / save_state take
    accelerate's FSDP path on gloo (torch FSDP runs on CPU). Returns whether it switched."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or acc.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin()
    # (torch 2.13 FSDP1 on CPU ranks segfaults in save_state with FULL_STATE_DICT, with or without
    # offload_to_cpu, while cloning the unsharded views: the CPU twin config uses SHARDED_STATE_DICT)
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    import torch
    from accelerate.state import PartialState
    acc.state.fsdp_plugin = plugin
    # both shared states: a later AcceleratorState() copies PartialState's values over its own.
    # MULTI_CPU ranks get device "cpu:0"; torch FSDP computes on "cpu" and rejects the mismatch.
    for shared in (PartialState._shared_state, acc.state.__dict__):
        shared["distributed_type"] = DistributedType.FSDP
        shared["device"] = torch.device("cpu")
    return True


def banner(acc, script: str, extra: str = "") -> str:
    """One start line with world size, backend, distributed type, mixed precision and device."""
    import torch.distributed as dist
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "none"
    line = (f"{script}: world_size={acc.num_processes} backend={backend} distributed_type={acc.distributed_type.value} "
            f"mixed_precision={acc.mixed_precision} device={acc.device}" + (f" {extra}" if extra else ""))
    acc.print(line)
    return line


# ------------------------------------------------------------------------- parent death guard
PR_SET_PDEATHSIG = 1


def die_with_launcher(poll_s: float = 1.0, force: bool = False) -> bool:
    """Arm the guard when this process was started by a launcher (accelerate / torchrun).
    Returns whether it is armed."""
    ppid = os.getppid()
    if not force and "LOCAL_RANK" not in os.environ and not _is_launcher(parent_cmdline(ppid)):
        return False
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except Exception:  # noqa: BLE001 - the watchdog below still covers it
            pass
    if os.getppid() != ppid:  # the launcher died before prctl took effect
        os._exit(143)

    def watch():
        while True:
            time.sleep(poll_s)
            if os.getppid() != ppid:
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)
                finally:
                    os._exit(143)

    threading.Thread(target=watch, name="die-with-launcher", daemon=True).start()
    return True


# ----------------------------------------------------------------------------- output folder
def identity_hash(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def claim_output(out: Path, identity: dict, is_main: bool, what: str = "--output") -> bool:
    """Check that `out` is new or holds a run of the same identity (model, config); write
    OUT/run.json on a new run. Returns whether the folder was created now."""
    rec = out / "run.json"
    if rec.exists():
        old = json.loads(rec.read_text()).get("identity", {})
        diff = sorted(k for k in set(old) | set(identity) if json.dumps(old.get(k), default=str)
                      != json.dumps(identity.get(k), default=str))
        if diff:
            shown = ", ".join(f"{k}: {old.get(k)!r} -> {identity.get(k)!r}" for k in diff[:4])
            raise UserError(f"{out} holds a run of another model or config ({shown}); pass a new {what} "
                            f"(e.g. {what} {out.parent / (out.name + '-2')}) or delete that folder")
        return False
    created = not out.exists()
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        tmp = rec.with_suffix(".tmp")
        tmp.write_text(json.dumps({"identity": identity}, indent=2, default=str) + "\n")
        tmp.replace(rec)
    return created


def remove_if_unused(out: Path, created: bool, keep_markers=("checkpoints", "ckpt", "summary.json")) -> None:
    """After a failed start: delete a folder this run created if it holds no checkpoint."""
    if created and out.exists() and not any((out / m).exists() for m in keep_markers):
        shutil.rmtree(out, ignore_errors=True)


def finished_or_claimed(acc, out: Path, identity: dict, summary_file: Path, steps: int) -> bool:
    """A re-launch into `out` that already holds a run (run.json): refused if it is another run (one
    line, claim_output), True (after saying so) if that run finished `steps` steps (its summary_file
    records them), False if it is to be resumed. A folder without run.json: False."""
    if not (out / "run.json").exists():
        return False
    claim_output(out, identity, False)  # raises on another model / config
    if summary_file.exists() and json.loads(summary_file.read_text()).get("steps", 0) >= steps:
        acc.print(f"already finished: {out} holds the finished run ({steps} steps, {summary_file.name}); "
                  "pass a new --output (or a larger --steps to continue it)")
        return True
    return False
