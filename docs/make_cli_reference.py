"""Write docs/cli.md, the command-line reference, from the argparse parsers themselves.

    .venv/bin/python docs/make_cli_reference.py           # (re)write docs/cli.md
    .venv/bin/python docs/make_cli_reference.py --check   # exit 1, saying what differs, when it is stale

Covers `hetsynth` (hetsynth.cli.build_parser: every subcommand, nested ones included) and the one
module entry point users start themselves under torchrun, `python -m hetsynth.runtime.compare`.
The other modules with parsers are started by hetsynth itself with arguments it builds, so they
are listed, not documented (INTERNAL). Output is deterministic: help is formatted at a fixed
width and no path of this machine appears.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "cli.md"
WIDTH = 100  # fixed: usage lines do not depend on the terminal

# Module entry points with a parser that users do not run: hetsynth starts them with the
# arguments it builds (a flag there is not an interface).
INTERNAL = {
    "hetsynth.runtime.worker": "one rank of `hetsynth run`; the launcher passes the plan and the run's options",
    "hetsynth.runtime.agent": "each node's torchrun wrapper that the launcher starts (dies with the launcher)",
    "hetsynth.profiling.profile_worker": "one rank of `hetsynth profile`",
    "hetsynth.profiling.model_timing": "the devices' part of `hetsynth plan --measure-ops` "
                                       "(profiling.measured launches it and reads its output)",
}


def _fixed_width(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH, max_help_position=32)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _fixed_width(sub)


def _oneline(text: str | None) -> str:
    return " ".join((text or "").split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    return _oneline(parser._get_formatter()._expand_help(action))


def _default(action: argparse.Action) -> str:
    if action.required or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return ""
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if action.default is False else "on"
    if isinstance(action.default, list) and not action.default:
        return "none"
    return f"`{action.default}`"


def _name(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.nargs != 0:
            metavar = action.metavar or action.dest.upper()
            suffix = {"*": f" [{metavar} ...]", "+": f" {metavar} [...]", "?": f" [{metavar}]"}.get(
                action.nargs, f" {metavar}")
            names += f" `{suffix.strip()}`"
        return names
    return f"`{action.metavar or action.dest}`" + (" ..." if action.nargs in ("*", "+", argparse.REMAINDER) else "")


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        positional_required = not action.option_strings and action.nargs not in ("?", "*", argparse.REMAINDER)
        required = "yes" if (action.option_strings and action.required) or positional_required else ""
        choices = ", ".join(f"`{c}`" for c in action.choices) if action.choices else ""
        rows.append([_name(action), _help(parser, action), required, _default(action), choices])
    if not rows:
        return []
    lines = ["| Argument | Help | Required | Default | Choices |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _usage(parser: argparse.ArgumentParser) -> list[str]:
    return ["```text", parser.format_usage().strip(), "```"]


def _section(parser: argparse.ArgumentParser, level: int, summary: str | None) -> list[str]:
    lines = [f"{'#' * level} `{parser.prog}`", ""]
    if summary:
        text = _oneline(summary).rstrip(".")
        lines += [text[0].upper() + text[1:] + ".", ""]
    lines += _usage(parser) + [""]
    table = _options_table(parser)
    if table:
        lines += table + [""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                lines += _section(sub, min(level + 1, 4), helps.get(name))
    return lines


def render() -> str:
    from hetsynth import cli
    from hetsynth.runtime import compare

    main = cli.build_parser()
    entry = compare.build_parser()
    for parser in (main, entry):
        _fixed_width(parser)
    sub = next(a for a in main._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: _oneline(a.help) for a in sub._choices_actions}
    lines = [
        "# Command-line reference",
        "",
        "<!-- generated by docs/make_cli_reference.py from the argparse parsers; do not edit by hand -->",
        "",
        "Regenerate with `.venv/bin/python docs/make_cli_reference.py` (`--check` says whether this file is stale).",
        "",
        "## `hetsynth`",
        "",
        _oneline(cli.__doc__).replace(" (COMMANDS)", ""),
        "",
        "The same command runs as `python -m hetsynth`.",
        "",
        *_usage(main),
        "",
        "| Command | What it does |",
        "|---|---|",
        *[f"| [`{name}`](#hetsynth-{name}) | {_cell(helps.get(name, ''))} |" for name in sub.choices],
        "",
    ]
    for name, parser in sub.choices.items():
        lines += _section(parser, 3, helps.get(name))
    lines += [
        "## Module entry points",
        "",
        "Started under torchrun (`torchrun --nproc-per-node N -m MODULE ...`) or by the launcher "
        "(`hetsynth.runtime.launch.launch_checked`), one process per rank.",
        "",
        *_section(entry, 3, "time several plans of one model (and torch DDP, FSDP2 or a user's loop on the same "
                            "ranks) interleaved, and write their step times, losses and phases as JSON"),
        "The full description of its entries (`--ddp`, `--fsdp`, `--user`, `--traced`) and of the report it "
        "writes is the module's docstring (`runtime/compare.py`).",
        "",
        "### Internal entry points",
        "",
        "These modules have parsers too, but hetsynth starts them itself with arguments it builds; their flags "
        "are not an interface and may change without notice:",
        "",
        *[f"- `python -m {module}`: {why}." for module, why in INTERNAL.items()],
        "",
    ]
    return "\n".join(lines)


def check(path: Path = OUTPUT) -> list[str]:
    """What differs between `path` and a fresh render (empty when up to date), as diff lines."""
    fresh = render()
    old = path.read_text() if path.is_file() else ""
    if old == fresh:
        return []
    if not old:
        return [f"{path.relative_to(ROOT)} is missing"]
    diff = difflib.unified_diff(old.splitlines(), fresh.splitlines(), f"{path.relative_to(ROOT)} (on disk)",
                                f"{path.relative_to(ROOT)} (from the parsers)", lineterm="", n=1)
    return list(diff)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write docs/cli.md from the hetsynth parsers")
    p.add_argument("--check", action="store_true", help="exit 1, showing the differences, when docs/cli.md is stale")
    args = p.parse_args(argv)
    if args.check:
        diff = check()
        if diff:
            print("docs/cli.md is stale; run .venv/bin/python docs/make_cli_reference.py", file=sys.stderr)
            print("\n".join(diff[:200]), file=sys.stderr)
            return 1
        print("docs/cli.md is up to date")
        return 0
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
