"""The `assay` command line: finds the command in `assay.commands.COMMANDS`, parses its flags into
its typed config (through tyro) and runs it; every error a user can cause is one line, exit 2.

Command modules are imported only when run, so `assay --help` starts instantly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

from assay.commands import COMMANDS, Command
from assay.core.errors import AssayError
from assay.core.memory import return_freed_memory, small_matmul_cache


def load(command: Command) -> tuple[type, Callable[[Any], Any]]:
    """The command's config class and run function (importing its module)."""
    module = importlib.import_module(command.path)
    return module.Config, module.run


REPLAY_SUMMARY = "Rerun a finished or interrupted run from its saved config.json."
GLOBAL_FLAGS = ("--debug", "--quiet")


def _usage(group: str | None = None) -> str:
    """The command list (or one group's: `assay sae --help`)."""
    names = [n for n in COMMANDS if group is None or n.split()[0] == group]
    width = max(len(n) for n in [*names, "replay"])
    head = f"assay {group} COMMAND" if group else "assay COMMAND"
    lines = [f"usage: {head} [OPTIONS]   ({head} --help for its options)", ""]
    if group is None:
        lines += ["Understand language models through their training data and their features.", ""]
    lines += ["commands:"] + [f"  {name:<{width}}  {COMMANDS[name].summary}" for name in names]
    if group is None:
        lines += [f"  {'replay':<{width}}  {REPLAY_SUMMARY}"]
        lines += ["", "global flags: --debug (show tracebacks), --quiet (warnings only), --version"]
    return "\n".join(lines)


def _groups() -> set[str]:
    """First words of the two-word commands (`sae` of `sae train`)."""
    return {name.split()[0] for name in COMMANDS if " " in name}


def _split_command(argv: list[str]) -> tuple[str, list[str]]:
    for words in (2, 1):
        name = " ".join(argv[:words])
        if name in COMMANDS or name == "replay":
            return name, argv[words:]
    if argv and argv[0] in _groups():
        raise AssayError(f"unknown command {' '.join(argv[:2])!r}; run `assay {argv[0]} --help` for the list")
    raise AssayError(f"unknown command {' '.join(argv[:1])!r}; run `assay --help` for the list")


def parse(name: str, args: Sequence[str]) -> tuple[Any, Callable[[Any], Any]]:
    """Parse a command's flags into its config (through tyro)."""
    import tyro  # lazy: `assay --help` must not wait for the parser library

    config_cls, run = load(COMMANDS[name])
    shown = io.StringIO()
    try:
        with contextlib.redirect_stderr(shown):  # tyro's usage errors come back as one line
            cfg: Any = tyro.cli(
                config_cls,
                args=list(args),
                prog=f"assay {name}",
                use_underscores=True,
                description=config_cls.__doc__,
                config=(tyro.conf.PositionalMetavarFromFieldName,),
            )
    except SystemExit as e:
        if e.code in (0, None):  # --help
            raise
        raise AssayError(usage_error(shown.getvalue(), name)) from None
    return cfg, run


def usage_error(text: str, name: str) -> str:
    """tyro's boxed usage error as one line: its message and the flags it names (a typo's
    suggestions, a missing argument) without their help texts, then where the full help is."""
    lines = [raw for raw in text.splitlines() if raw.strip()]
    sections: list[list[str]] = [[]]
    for raw in lines[1:] if len(lines) > 1 else lines:  # the first: the box's title (top or above a rule)
        line = raw.rstrip().removesuffix("│").removeprefix("│").rstrip()  # indentation kept
        content = line.lstrip()
        if not content or content.startswith("╰"):
            continue  # the box's bottom
        if set(content) <= {"─", "-"}:
            sections.append([])  # a rule between the box's sections (ASCII where not UTF-8)
        elif len(line) - len(content) < 8:  # deeper lines are a flag's help text
            sections[-1].append(content)
    kept = [
        " ".join(section)
        for section in sections
        if section and not section[0].startswith(("For full helptext", "Argument helptext"))
    ]
    words = " ".join("; ".join(kept).split()) or "invalid arguments"
    return f"{words} (see `assay {name} --help`)"


def _replay_config() -> type:
    """The `assay replay` config: built on first use (tyro loads only when a command runs), its
    help from each field's `tyro.conf.arg`."""
    import tyro  # lazy: `assay --help` must not wait for the parser library

    def arg(tp: Any, help: str, *more: Any) -> Any:
        return Annotated[(tp, tyro.conf.arg(help=help), *more)]  # type: ignore[valid-type]

    return dataclasses.make_dataclass(
        "ReplayConfig",
        [
            ("run_dir", arg(str, "The run folder (OUT, or OUT.part) to replay.", tyro.conf.Positional)),
            ("out", arg(str | None, "Write into this folder (default: RUN_DIR itself)."), None),
            ("overwrite", arg(bool, "Replace a finished run in the output folder."), False),
            (
                "trust_remote_code",
                arg(bool, "Run code shipped with the run's model (its saved config never allows it)."),
                False,
            ),
        ],
    )


def replay(args: list[str]) -> Any:
    """`assay replay RUN_DIR [--out NEW] [--overwrite] [--trust_remote_code]`: run a saved config
    again (parsed like every command: unknown flags are refused)."""
    import tyro  # lazy: `assay --help` must not wait for the parser library

    from assay.core.console import note  # lazy: replay only
    from assay.core.runs import config_from_dict, load_run_config  # lazy: replay only

    cfg: Any = tyro.cli(
        _replay_config(),
        args=args,
        prog="assay replay",
        description=REPLAY_SUMMARY,
        use_underscores=True,
        config=(tyro.conf.PositionalMetavarFromFieldName,),
    )
    saved = load_run_config(cfg.run_dir)
    command = saved.get("command")
    if command not in COMMANDS:
        raise AssayError(f"{cfg.run_dir} was made by an unknown command {command!r}")
    if not isinstance(saved.get("config"), dict):
        raise AssayError(
            f'{cfg.run_dir}: its config.json holds no settings ("config"); it cannot be replayed'
        )
    config_cls, run = load(COMMANDS[command])
    data = dict(saved["config"])
    data["out"] = cfg.out if cfg.out is not None else _folder_of(cfg.run_dir)
    data["overwrite"] = cfg.overwrite
    try:  # only this command line may allow a model's own code, never the saved JSON
        config = config_from_dict(config_cls, data, trust_remote_code=cfg.trust_remote_code)
    except (TypeError, ValueError, AssayError) as e:
        raise AssayError(f"{cfg.run_dir}: its config.json does not fit `assay {command}` ({e})") from None
    note(f"replaying `assay {command}` into {data['out']}")
    return run(config)


def _folder_of(run_dir: str) -> str:
    """The run's own folder: RUN_DIR, or OUT for RUN_DIR = OUT.part (where it resumes), wherever
    the folder has been moved since it was written."""
    path = Path(run_dir.rstrip("/"))
    return str(path.with_name(path.name.removesuffix(".part")))


def entry() -> int:
    """`assay` as a whole process (the console script, `python -m assay`, torchrun).

    Lets torch's idle CPU threads spin briefly before sleeping (`short_spin`), then
    imports the command and the model libraries up front with their objects frozen out of the
    garbage collector, and freezes everything left at the end, so that neither the run's
    collections nor interpreter shutdown walk them (see `frozen_imports`). `main` itself
    leaves the collector alone, so tests can call it in-process.
    """
    import gc  # lazy: only the console entry point freezes the collector

    from assay.core.memory import frozen_imports  # lazy: entry point only
    from assay.core.threads import short_spin  # lazy: entry point only

    short_spin()  # before anything imports torch (see assay.core.threads)
    command = _command_to_preload(sys.argv[1:])
    if command is not None:
        with frozen_imports():
            load(command)
            for library in command.libraries:
                importlib.import_module(library)
    try:
        code = main()
        sys.stdout.flush()  # a reader gone shows here, not as an ignored error at shutdown
    except BrokenPipeError:
        return _reader_gone()
    gc.freeze()  # nothing is collected after this: shutdown need not walk every live object
    return code


def _reader_gone() -> int:
    """The exit status when whoever read stdout stopped reading (`assay score --help | head`):
    128 + SIGPIPE, as a process killed by the signal would give, and no traceback. The rest of
    stdout goes to /dev/null, so flushing it at exit does not fail again."""
    import os  # lazy: only on this path

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + 13


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
    from assay.core.console import install_cli_handler  # lazy: keeps `assay --help` instant

    args = list(sys.argv[1:] if argv is None else argv)
    debug, quiet = "--debug" in args, "--quiet" in args
    args = [a for a in args if a not in GLOBAL_FLAGS]
    install_cli_handler(quiet)
    early = _help_or_version(args)
    if early is not None:
        return early
    name = args[0]
    return_freed_memory()
    small_matmul_cache()
    try:
        name, rest = _split_command(args)
        if name == "replay":
            replay(rest)
        else:
            cfg, run = parse(name, rest)
            run(cfg)
        _finish_distributed()
    except (AssayError, OSError) as e:
        from assay.core.disk import as_disk_full  # lazy: loads numpy

        message = e if isinstance(e, AssayError) else as_disk_full(e, Path("."))
        if message is None:  # any other OSError is a bug to report, with its traceback
            raise
        if debug:
            traceback.print_exc()
        _fail(f"assay {name}: error{_rank_label()}: {message}")
        return 2
    except KeyboardInterrupt:
        print(f"assay {name}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return 0


def _help_or_version(args: list[str]) -> int | None:
    """The exit code when `args` ask for the command list, a group's list or the version."""
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] == "--version":
        from assay.core.runs import package_version  # lazy: keeps `assay --version` instant

        print(f"assay {package_version()}")
        return 0
    if args[0] in _groups() and (len(args) == 1 or args[1] in ("-h", "--help", "help")):
        print(_usage(args[0]), file=sys.stdout if len(args) > 1 else sys.stderr)
        return 0 if len(args) > 1 else 2
    return None


def _rank_label() -> str:
    """The " (rank R of W)" label under torchrun, so a failing rank is named; "" in one process."""
    import os  # lazy: only under torchrun

    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f" (rank {os.environ.get('RANK', '0')} of {world})" if world > 1 else ""


def _fail(message: str) -> None:
    """Print the error; under torchrun, leave at once with status 2 so torchrun stops the
    other ranks (they may be waiting in a collective that this rank will never join)."""
    print(message, file=sys.stderr, flush=True)
    if _rank_label():
        import os  # lazy: only under torchrun

        sys.stdout.flush()
        os._exit(2)  # not destroy_process_group(): with peers inside a collective it can block


def _finish_distributed() -> None:
    """Leave the process group cleanly after a successful distributed run, then exit at once.

    The barrier lets no rank shut its connections while a peer still finishes the last
    collective. Exiting with os._exit skips interpreter finalization, where gloo's worker
    threads were seen to abort a rank (std::terminate, SIGABRT) after all its work was done;
    every output is already written and closed by then."""
    if _rank_label():
        import os  # lazy: only under torchrun

        from assay.core.distributed import finish_process_group  # lazy: loads torch

        finish_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
