"""The `assay` command line: finds the command in `assay.commands.COMMANDS`, parses its flags into
its typed config (through tyro) and runs it; every error a user can cause is one line, exit 2.

Command modules are imported only when run, so `assay --help` starts instantly.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from assay.commands import COMMANDS, Command
from assay.core.errors import AssayError
from assay.core.memory import return_freed_memory


def load(command: Command) -> tuple[type, Callable[[Any], Any]]:
    """The command's config class and run function (importing its module)."""
    module = importlib.import_module(command.path)
    return module.Config, module.run


def _usage() -> str:
    width = max(len(n) for n in [*COMMANDS, "replay"])
    lines = [
        "usage: assay COMMAND [OPTIONS]   (assay COMMAND --help for its options)",
        "",
        "Understand language models through their training data and their features.",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    lines += [
        f"  {'replay':<{width}}  Rerun a finished or interrupted run from its saved config.json.",
        "",
        "global flags: --debug (show tracebacks)",
    ]
    return "\n".join(lines)


def _split_command(argv: list[str]) -> tuple[str, list[str]]:
    for words in (2, 1):
        name = " ".join(argv[:words])
        if name in COMMANDS or name == "replay":
            return name, argv[words:]
    raise AssayError(f"unknown command {' '.join(argv[:1])!r}; run `assay --help` for the list")


def parse(name: str, args: Sequence[str]) -> tuple[Any, Callable[[Any], Any]]:
    """Parse a command's flags into its config (through tyro)."""
    import tyro

    config_cls, run = load(COMMANDS[name])
    cfg: Any = tyro.cli(
        config_cls,
        args=list(args),
        prog=f"assay {name}",
        use_underscores=True,
        description=config_cls.__doc__,
        config=(tyro.conf.PositionalMetavarFromFieldName,),
    )
    return cfg, run


def replay(args: list[str]) -> Any:
    """`assay replay RUN_DIR [--out NEW] [--overwrite]`: run a saved config again."""
    from assay.core.console import note
    from assay.core.runs import config_from_dict, load_run_config

    if not args or args[0].startswith("-"):
        raise AssayError("usage: assay replay RUN_DIR [--out NEW_DIR] [--overwrite]")
    saved = load_run_config(args[0])
    if saved["command"] not in COMMANDS:
        raise AssayError(f"{args[0]} was made by an unknown command {saved['command']!r}")
    config_cls, run = load(COMMANDS[saved["command"]])
    data = dict(saved["config"])
    if "--out" in args:
        data["out"] = args[args.index("--out") + 1]
    data["overwrite"] = "--overwrite" in args or data.get("overwrite", False)
    note(f"replaying `assay {saved['command']}` into {data['out']}")
    return run(config_from_dict(config_cls, data))


def entry() -> int:
    """`assay` as a whole process (the console script, `python -m assay`, torchrun).

    Imports the command and the model libraries up front with their objects frozen out of the
    garbage collector, and freezes everything left at the end, so that neither the run's
    collections nor interpreter shutdown walk them (see `frozen_imports`). `main` itself
    leaves the collector alone, so tests can call it in-process.
    """
    import gc

    from assay.core.memory import frozen_imports

    command = _command_to_preload(sys.argv[1:])
    if command is not None:
        with frozen_imports():
            load(command)
            for library in command.libraries:
                importlib.import_module(library)
    code = main()
    gc.freeze()  # nothing is collected after this: shutdown need not walk every live object
    return code


def _command_to_preload(args: list[str]) -> Command | None:
    """The command `args` runs, unless they ask for help or name none (then nothing is worth
    importing ahead)."""
    if not args or any(a in ("-h", "--help", "help") for a in args):
        return None
    try:
        name, _ = _split_command(args)
    except AssayError:
        return None
    return COMMANDS.get(name)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the process exit code. Errors are one line unless --debug."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name = args[0]
    return_freed_memory()
    try:
        name, rest = _split_command(args)
        if name == "replay":
            replay(rest)
        else:
            cfg, run = parse(name, rest)
            run(cfg)
        _finish_distributed()
    except AssayError as e:
        if debug:
            traceback.print_exc()
        _fail(f"assay {name}: error{_rank_label()}: {e}")
        return 2
    except KeyboardInterrupt:
        print(f"assay {name}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return 0


def _rank_label() -> str:
    """The " (rank R of W)" label under torchrun, so a failing rank is named; "" in one process."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f" (rank {os.environ.get('RANK', '0')} of {world})" if world > 1 else ""


def _fail(message: str) -> None:
    """Print the error; under torchrun, leave at once with status 2 so torchrun stops the
    other ranks (they may be waiting in a collective that this rank will never join)."""
    print(message, file=sys.stderr, flush=True)
    if _rank_label():
        import os

        sys.stdout.flush()
        os._exit(2)  # not destroy_process_group(): with peers inside a collective it can block


def _finish_distributed() -> None:
    """Leave the process group cleanly after a successful distributed run, then exit at once.

    The barrier lets no rank shut its connections while a peer still finishes the last
    collective. Exiting with os._exit skips interpreter finalization, where gloo's worker
    threads were seen to abort a rank (std::terminate, SIGABRT) after all its work was done;
    every output is already written and closed by then."""
    if _rank_label():
        import os

        from assay.core.distributed import finish_process_group

        finish_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
