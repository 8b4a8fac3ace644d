"""The ``pytest-msprobe`` command line (also ``python -m pytest_msprobe``).

    pytest-msprobe compare TARGET BASELINE -o OUT [--fuzzy] [--mode M] [-j N] [threshold options]
    pytest-msprobe compare -tp TARGET -gp GOLDEN -o OUT       # msprobe 26.x's form
    pytest-msprobe compare -i compare.json -o OUT [-s]        # msprobe 8.x's form
    pytest-msprobe --version

Exit status: 0 when every API is within its thresholds, 1 when any breaches, the target lacks a step or rank
the baseline has, or too little of the baseline found a partner (``--max-unmatched``), 2 on unusable input or a
usage error (one line on stderr naming the file and the problem; no report is written): among them a dump
compared with itself, and a report folder ``-o`` that is, or is inside, TARGET or BASELINE.

A missing step or rank is a 1, not a 2: both dumps are usable, and what they show is that the run being
checked did not do all the baseline did (it stopped early, a rank died, the dumped steps changed), which is
the run's failure, for a CI gate as red as a breach. A step or rank only the target has is reported and
passes: nothing holds it to anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_msprobe.errors import ConfigError, DumpFormatError, MsprobeError
from pytest_msprobe.format.files import config_error, read_json

PROG = "pytest-msprobe"

# msprobe 26.x compare modes other than "auto": other tools' data (offline models, torchair graphs, ATB)
MSPROBE_MODES = {
    "offline_data": "compares offline-inference dump folders",
    "torchair": "compares torchair graph dumps",
    "offline_model": "runs and compares offline (om/onnx) models",
    "atb": "compares Ascend Transformer Boost dumps",
}
# msprobe 26.x compare options this compare does not take: flags, nargs, what they are for
MSPROBE_REFUSED: tuple[tuple[tuple[str, ...], str | None, str], ...] = (
    (("-cm", "--cell_mapping"), "?", "maps MindSpore cells to PyTorch modules"),
    (("-am", "--api_mapping"), "?", "maps MindSpore APIs to PyTorch APIs"),
    (("-lm", "--layer_mapping"), "?", "maps layers across frameworks"),
    (("-dm", "--data_mapping"), None, "pairs rows by a name mapping file"),
    (("--rank",), None, "selects ranks of a MindSpore static-graph compare"),
    (("--step",), None, "selects steps of a MindSpore static-graph compare"),
    (("--consistent_check",), "flag", "compares training with inference (verl)"),
    (("--backend",), None, "names the training backend of --consistent_check"),
    (("--config",), None, "post-processes tensors of --consistent_check"),
    (("-fr", "--fusion_rule_file"), None, "belongs to the offline_data mode"),
    (("-qfr", "--quant_fusion_rule_file"), None, "belongs to the offline_data mode"),
    (("-cfr", "--close_fusion_rule_file"), None, "belongs to the offline_data mode"),
    (("--input_data",), None, "belongs to the offline_model mode"),
    (("--input_shape",), None, "belongs to the offline_model mode"),
    (("--output_size",), None, "belongs to the offline_model mode"),
    (("--dym_shape_range",), None, "belongs to the offline_model mode"),
    (("-ofs", "--onnx_fusion_switch"), None, "belongs to the offline_model mode"),
)


def version() -> str:
    """The installed distribution's version (its metadata); the package's own where it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(PROG)
    except PackageNotFoundError:
        from pytest_msprobe.version import __version__

        return __version__


class _VersionAction(argparse.Action):
    """``--version``: the metadata is read only when asked for (~15 ms, on every run otherwise)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, help: str | None = None):
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(f"{PROG} {version()}")
        parser.exit()


def _refused_dest(flags: tuple[str, ...]) -> str:
    return "refused_" + flags[-1].lstrip("-")


def build_parser() -> argparse.ArgumentParser:
    from pytest_msprobe.options import add_threshold_options
    from pytest_msprobe.settings import parse_number

    parser = argparse.ArgumentParser(prog=PROG, description="Precision tools for msprobe-format dumps.")
    parser.add_argument("-V", "--version", action=_VersionAction, help="print the version and exit")
    # msprobe's own command line takes the framework before the command (msprobe -f pytorch compare ...)
    parser.add_argument("-f", "--framework", choices=["pytorch"], default="pytorch", help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cmp = commands.add_parser(
        "compare",
        help="compare a dump with a baseline dump",
        description="Compare a target dump (e.g. the NPU run) with a baseline dump (e.g. the GPU run): "
        "align their API calls, judge every row against the thresholds, name the first divergence, and "
        "write compare_result_{timestamp}.xlsx, compare_result_{timestamp}.csv, advisor_{timestamp}.txt "
        "and summary.json to OUT. The dumps are given as TARGET BASELINE, as msprobe 26.x's "
        "-tp TARGET -gp GOLDEN, or as msprobe 8.x's -i compare.json.",
        epilog="exit status: 0 all within thresholds, 1 any API breaches or a step/rank of the baseline is "
        "missing in the target, 2 unusable input or usage error (an msprobe option this compare does not "
        "take, such as -dm or -cm, is a usage error that says what it is for)",
    )
    cmp.set_defaults(command_parser=cmp)
    cmp.add_argument(
        "target",
        nargs="?",
        help="dump to check: a dump.json, a rank folder (rank, rank{R}, proc{PID}), a step folder or a "
        "dump root holding step{N}/",
    )
    cmp.add_argument("baseline", nargs="?", help="reference dump, in any of the same forms")
    cmp.add_argument(
        "-tp",
        "--target_path",
        "--target-path",
        dest="target_path",
        metavar="TARGET",
        help="msprobe 26.x's spelling of TARGET (NPU_Stack_Info is then filled, as msprobe 26.x does)",
    )
    cmp.add_argument(
        "-gp",
        "--golden_path",
        "--golden-path",
        dest="golden_path",
        metavar="GOLDEN",
        help="msprobe 26.x's spelling of BASELINE",
    )
    cmp.add_argument(
        "-i",
        "--input-path",
        "--input_path",
        dest="input_path",
        metavar="COMPARE_JSON",
        help='msprobe 8.x compare.json: {"npu_path": ..., "bench_path": ..., "stack_path": ...}',
    )
    cmp.add_argument(
        "-o",
        "--output-path",
        "--output_path",
        dest="output_path",
        required=True,
        metavar="OUT",
        help="report folder",
    )
    cmp.add_argument(
        "-s",
        "--stack-mode",
        "--stack_mode",
        dest="stack_mode",
        action="store_true",
        help="fill NPU_Stack_Info with each API's call stack (from stack.json)",
    )
    cmp.add_argument(
        "-fm",
        "--fuzzy",
        "--fuzzy-match",
        "--fuzzy_match",
        dest="fuzzy",
        action="store_true",
        help="also pair calls of different API names whose tensors have the same dtypes and shapes",
    )
    cmp.add_argument(
        "-m",
        "--mode",
        choices=["auto", "statistics", "tensor", "md5", *MSPROBE_MODES],
        default="auto",
        metavar="{auto,statistics,tensor,md5}",
        help="auto: tensor when both dumps hold tensor files, md5 when both hold CRCs, else statistics",
    )
    cmp.add_argument(
        "-j",
        "--jobs",
        type=lambda text: int(parse_number(text, minimum=1, whole=True)),
        default=None,
        metavar="N",
        help="processes comparing the dump pairs (step, rank) in parallel; a single pair spreads its tensor "
        "files over them (default: the number of CPUs; 1: all in this process)",
    )
    cmp.add_argument(
        "-hl", "--highlight", action="store_true", help=argparse.SUPPRESS
    )  # msprobe's; always on here
    cmp.add_argument(
        "--xlsx",
        action="store_true",
        help="(msprobe 26.x) accepted: the xlsx is always written, beside the CSV",
    )
    cmp.add_argument(
        "-da",
        "--diff_analyze",
        action="store_true",
        help="(msprobe 26.x) accepted: the first divergence is always named (summary.json, advisor)",
    )
    cmp.add_argument(
        "-tensor_log",
        "--is_print_compare_log",
        action="store_true",
        help="(msprobe 26.x) accepted: the console summary lists the worst rows",
    )
    for flags, nargs, _ in MSPROBE_REFUSED:
        if nargs == "flag":
            cmp.add_argument(*flags, dest=_refused_dest(flags), action="store_true", help=argparse.SUPPRESS)
        else:
            cmp.add_argument(*flags, dest=_refused_dest(flags), nargs=nargs, const=True if nargs else None,
                             help=argparse.SUPPRESS)  # fmt: skip
    cmp.add_argument(
        "--self-check",
        dest="self_check",
        action="store_true",
        help="fail when a call's own error (its output against the float64 replay of its own inputs) is out "
        "of line; the target needs own errors: a self_check.json beside each dump.json, or tensor files",
    )
    cmp.add_argument(
        "--replay",
        dest="replay",
        choices=["auto", "all", "none"],
        default="auto",
        help="which calls of a tensor dump are replayed in float64 for their own errors (self_check.json files "
        "are read instead where they exist): auto (default), those beyond a threshold and the calls they read "
        "(every call across devices and with --self-check); all; none",
    )
    cmp.add_argument(
        "--no-replay",
        dest="replay",
        action="store_const",
        const="none",
        help="the same as --replay=none",
    )
    cmp.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    add_threshold_options(cmp.add_argument)
    chk = commands.add_parser(
        "config-check",
        help="compare the training checklists of two dumps (data, weights, settings, environment)",
        description="Compare the checklists recorded with two dumps, step by step and rank by rank: the "
        "input batches, the weights and buffers at the start of each step, the optimizers' settings, the "
        "model's structure (failures), and the environment variables, library versions and torch switches "
        "that change numerics (context). msprobe's pre-training config check, from the dumps.",
        epilog="exit status: 0 no failing difference (context may differ), 1 a data, weight, buffer, "
        "hyperparameter or structure difference, 2 unusable input (no checklist to compare) or usage error",
    )
    chk.set_defaults(command_parser=chk)
    chk.add_argument("target", metavar="TARGET", help="dump to check (dump root, step or rank folder)")
    chk.add_argument("baseline", metavar="BASELINE", help="reference dump, in any of the same forms")
    chk.add_argument("-o", "--output", dest="output_path", metavar="OUT",
                     help="also write OUT/config_check.json")  # fmt: skip
    rep = commands.add_parser(
        "replay",
        help="replay every API call of a tensor dump on the CPU in float64 and judge each call's own error",
        description="Rebuild each recorded API call of a tensor dump from its dumped inputs, run it on the "
        "CPU in float64, and judge its dumped output (forward) or outgoing gradients (backward) against that "
        "replay: its own error, whatever flowed into it. Writes OUT/replay.json; exits 1 when a call is out of line, 0 otherwise, 2 on a usage error.",
    )
    rep.set_defaults(command_parser=rep)
    rep.add_argument(
        "dump", metavar="DUMP", help="a tensor dump: dump root, step or rank folder, or dump.json"
    )
    rep.add_argument("-o", "--output", dest="output_path", required=True, metavar="OUT", help="report folder")
    rep.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    return parser


def _resolve(value: str, compare_json: str) -> str:
    """A relative path of a compare.json: from the current folder (as msprobe does), else from the
    compare.json's folder or the nearest folder above it where it exists."""
    if os.path.isabs(value) or os.path.exists(value):
        return value
    folder = os.path.dirname(os.path.abspath(compare_json))
    while True:
        candidate = os.path.join(folder, value)
        if os.path.exists(candidate):
            return os.path.normpath(candidate)
        parent = os.path.dirname(folder)
        if parent == folder:
            return value
        folder = parent


def _from_compare_json(path: str) -> tuple[str, str, str | None]:
    """npu_path, bench_path and stack_path of an msprobe compare.json."""
    doc = read_json(path, config_error)
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object with npu_path and bench_path")
    found: dict[str, str | None] = {}
    for key in ("npu_path", "bench_path", "stack_path"):
        value = doc.get(key)
        if value is None or value == "":
            if key != "stack_path":
                raise ConfigError(f"{path}: missing {key!r}")
            found[key] = None
            continue
        if not isinstance(value, str):
            raise ConfigError(f"{path}: {key} must be a path string, got {value!r}")
        found[key] = _resolve(value, path)
    return str(found["npu_path"]), str(found["bench_path"]), found["stack_path"]


def _run_compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pytest_msprobe.compare.dumps import read_stack_file
    from pytest_msprobe.compare.run import compare
    from pytest_msprobe.options import thresholds_from_options
    from pytest_msprobe.report import console_summary, write_reports

    _refuse_msprobe_options(args, parser)
    stack_path = None
    stack = args.stack_mode
    forms = [
        form
        for form, given in (
            ("TARGET BASELINE", args.target or args.baseline),
            ("-tp TARGET -gp GOLDEN", args.target_path or args.golden_path),
            ("-i COMPARE_JSON", args.input_path),
        )
        if given
    ]
    if len(forms) > 1:
        parser.error(f"give the dumps one way, not as {' and as '.join(forms)}")
    if args.input_path:
        target, baseline, stack_path = _from_compare_json(args.input_path)
    elif args.target_path or args.golden_path:
        if not (args.target_path and args.golden_path):
            parser.error(
                "-tp TARGET and -gp GOLDEN go together: "
                + ("-gp" if args.target_path else "-tp")
                + " is missing"
            )
        target, baseline = args.target_path, args.golden_path
        stack = True  # msprobe 26.x fills NPU_Stack_Info whenever stack.json is there
    elif args.target and args.baseline:
        target, baseline = args.target, args.baseline
    else:
        parser.error("compare needs TARGET and BASELINE (or -tp TARGET -gp GOLDEN, or -i COMPARE_JSON)")
    refuse_output_inside(args.output_path, ("TARGET", target), ("BASELINE", baseline))
    thresholds = thresholds_from_options(args)
    result = compare(
        target,
        baseline,
        thresholds=thresholds,
        fuzzy=args.fuzzy,
        mode=args.mode,
        jobs=args.jobs,
        stack=stack and stack_path is None,
        self_check=args.self_check,
        replay=args.replay,
    )
    if args.stack_mode and stack_path is not None:
        # the compare.json names the stack file: msprobe reads it instead of the one beside the dump
        if not os.path.isfile(stack_path):
            raise ConfigError(f"{stack_path}: stack_path is not a file")
        stacks = {name: tuple(frames) for name, frames in read_stack_file(Path(stack_path)).items()}
        result = dataclasses.replace(result, stacks={**stacks, **result.stacks})
    paths = write_reports(result, args.output_path)
    code = 0 if result.passed else 1
    if not args.quiet:
        try:
            print(console_summary(result, paths), flush=True)
        except BrokenPipeError:  # (piped into head): the verdict stands, the rest of the text has no reader
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


def _refuse_msprobe_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A usage error for an msprobe compare option or mode this compare does not take, saying what it is for."""
    if args.mode in MSPROBE_MODES:
        parser.error(
            f"-m {args.mode}: msprobe's {args.mode} mode {MSPROBE_MODES[args.mode]}; pytest-msprobe compares "
            "msprobe dumps (dump.json): -m auto, statistics, tensor or md5"
        )
    for flags, _, what in MSPROBE_REFUSED:
        if getattr(args, _refused_dest(flags)) not in (None, False):
            parser.error(f"{'/'.join(flags)}: msprobe's option that {what}; pytest-msprobe does not take it")


def refuse_output_inside(out: str, *dumps: tuple[str, str]) -> None:
    """Refuse a report folder that is a dump read, or inside one: the reports would change the dump (and a
    later compare of it would find them). ``dumps``: (label, path) pairs, as the usage names them; a dump.json
    given by name stands for its folder."""
    where = Path(out).resolve()
    for label, given in dumps:
        root = Path(given).resolve()
        what = f"{label} {given}"
        if root.is_file():
            root, what = root.parent, f"the folder of {what}"
        if where == root or root in where.parents:
            relation = "is" if where == root else "is inside"
            raise ConfigError(
                f"-o {out} {relation} {what}: reports written into a dump change it; write them elsewhere"
            )


def _run_replay(args: argparse.Namespace) -> int:
    from pytest_msprobe.replay.offline import replay_dump, write_replay

    refuse_output_inside(args.output_path, ("DUMP", args.dump))
    result = replay_dump(args.dump)
    replayed = sum(1 for c in result.calls if not c.skipped)
    if not replayed:  # nothing judged is no pass
        first = next((f"{c.name}: {c.skipped}" for c in result.calls), "it records no API call")
        raise DumpFormatError(args.dump, f"no call could be replayed ({first})")
    path = write_replay(result, args.output_path)
    bad = result.out_of_line
    if not args.quiet:
        emulated = sorted({c.emulated for c in result.calls if c.emulated})
        declared = sum(1 for c in result.calls if c.emulated)
        # the calls whose kernels' operands were rounded (cast) as their device declares it computes them
        as_declared = (
            f" ({declared} with {' and '.join(emulated)} operands, as the device declares)"
            if declared
            else ""
        )
        print(f"msprobe replay: {replayed} of {len(result.calls)} calls replayed in float64{as_declared}, "
              f"{len(bad)} out of line; {path}")  # fmt: skip
        for call in bad[:10]:
            why = "; ".join(o.reason for o in call.outputs if o is not None and o.out_of_line)
            where = "".join(
                f", {k} {v}" for k, v in (("step", call.step), ("rank", call.rank)) if v is not None
            )
            print(f"  {call.name}{f' ({where[2:]})' if where else ''}: {why}")
    return 1 if bad else 0


def _run_config_check(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from pytest_msprobe.compare.checklist import compare_checklists, recorded_calls
    from pytest_msprobe.compare.run import pair_locations
    from pytest_msprobe.format.files import write_text
    from pytest_msprobe.format.layout import discover
    from pytest_msprobe.thresholds import Thresholds

    pairs, unpaired, _ = pair_locations(
        discover(args.target), discover(args.baseline), args.target, args.baseline
    )
    # a numerics setting that differs is placed at the first call both dumps record that it changes
    result = compare_checklists(
        [(t.path, b.path, t.step, t.rank) for t, b in pairs], Thresholds(), calls=recorded_calls(pairs)
    )
    if not result.checked:  # nothing compared is no pass
        why = result.unchecked[0] if result.unchecked else "no dump pair"
        raise DumpFormatError(args.baseline, f"no checklist to compare ({why})")
    several = len({t.rank for t, _ in pairs}) > 1
    status = "FAILED" if result.failures else "PASSED"
    print(
        f"{PROG} config-check: {status}: {result.checked} dump pair(s) compared, {len(result.failures)} "
        f"failing difference(s), {len(result.context)} in the context"
    )
    for d in result.failures[:20]:
        print(f"  {d.headline(several)}")
    if len(result.failures) > 20:
        print(f"  ... and {len(result.failures) - 20} more")
    for d in result.context:
        print(f"  context: {d.context_text()}")
    for note in (*result.unchecked, *unpaired):
        print(f"  not checked: {note}")
    if args.output_path:
        out = Path(args.output_path)
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / "config_check.json", json.dumps(result.to_dict(), indent=2) + "\n")
    return 1 if result.failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        # a usage error of a command prints that command's usage, not the top-level one
        command_parser: argparse.ArgumentParser = getattr(args, "command_parser", parser)
        if unknown:
            command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        if args.command == "compare":
            return _run_compare(args, command_parser)
        if args.command == "replay":
            return _run_replay(args)
        if args.command == "config-check":
            return _run_config_check(args)
        parser.error(f"unknown command {args.command!r}")
    except SystemExit as exc:  # argparse's usage errors (2) and --help (0)
        code: Any = exc.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    except MsprobeError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
