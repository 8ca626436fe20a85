"""The command line: ``lowrank-audit MODEL [options]``, ``lowrank-audit rules [CODE]`` and ``lowrank-audit check-plan``.

Exit codes: 0 clean (the verdict PASS, or UNMEASURED: nothing measured the plan, or REVIEW / FAIL below --fail-on),
1 findings at or above --fail-on (``--fail-on unmeasured``: anything but PASS), 2 bad input (one line on stderr, no
report written), 3 an internal error (a bug: one line, the traceback with --verbose), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from .._env import own_process
from .argparser import UsageError, _Parser, cache_usable
from .shared_flags import add_shared, unescape
from ..config import FailOn
from ..errors import AuditError, ExitCode, escape, first_line
from ..options import SpectraBackend, Tracer

if TYPE_CHECKING:
    from ..options import AuditOptions, LoadOptions


def _output_help() -> tuple[str, str]:
    """--format's and -o's help, from the one table of formats (:data:`auditor.render.REPORTERS`)."""
    from ..render import REPORTERS, Stdout, stdout_of

    files = ",".join(r.suffix.lstrip(".") for r in REPORTERS.values() if stdout_of(r.name) is not Stdout.LOG)
    docs = "/".join(f for f in REPORTERS if stdout_of(f) is Stdout.DOCUMENT)
    logs = " and ".join(f"{f} annotations" for f in REPORTERS if stdout_of(f) is Stdout.LOG)
    return (f"comma-separated, from {', '.join(REPORTERS)} (default: text); sarif is SARIF 2.1.0 for code "
            "scanning, github prints workflow-command annotations for a GitHub Actions log",
            f"write reports here as lowrank-audit.{{{files}}}; without it {docs} go to stdout; the table (unless -q) "
            f"and {logs} always go to stdout")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="lowrank-audit",
        description="Audit a PyTorch model before low-rank factorization: parameter shares, break-even ranks, "
                    "singular-value spectra, suggested ranks, and a review of a compression plan.",
        epilog="Sources: file.py:factory, package.module:factory, a Hugging Face directory or config.json, a "
               ".safetensors file or sharded directory (weights only), torchvision:NAME, timm:NAME. "
               "`lowrank-audit rules` lists the rules; `lowrank-audit factorize --help` applies a plan; "
               "`lowrank-audit check-plan PLAN... [--model SOURCE]` checks plan files (the pre-commit hook). "
               "Verdicts: PASS (nothing found, the plan measured with --calibration), UNMEASURED (nothing found, "
               "but no calibration data measured the ranks: energy-based estimates), REVIEW (warnings), FAIL "
               "(errors). Exit codes: 0 clean, 1 findings at or above --fail-on, 2 bad input (one line, nothing "
               "written), 3 internal error (a bug; --verbose shows the traceback), 130 interrupted; --fail-on "
               "unmeasured exits 1 on anything but PASS.",
    )
    add_shared(p, "model")
    _common_flags(p)
    p.add_argument("--estimate", action="store_true", help="predict the audit's wall time per stage, peak memory and "
                   "disk from the shapes, the calibration and a few seconds of measurement; run nothing else")
    _input_flags(p.add_argument_group("inputs"))
    _plan_flags(p.add_argument_group("plan"))
    _output_flags(p.add_argument_group("output"))
    _threshold_flags(p.add_argument_group("thresholds (override pyproject.toml and the plan)"))
    calibration = p.add_argument_group("calibration (measured rank floors; docs/calibration.md)")
    _calibration_flags(calibration)
    _tier_flags(calibration)
    _device_flags(calibration)
    _speed_flags(p.add_argument_group("speed (measured latency and memory; docs/performance.md)"))
    _spectra_flags(p.add_argument_group("spectra"))
    return p


def _input_flags(g: "argparse._ArgumentGroup") -> None:
    """Where the model's inputs and weights come from, and how it is traced."""
    add_shared(g, "input-shape", "input-ids", "weights")
    g.add_argument("--partial", action="store_true",
                   help="audit even when the checkpoint lacks some of the model's weights (they are listed)")
    g.add_argument("--tracer", choices=[t.value for t in Tracer], default=Tracer.AUTO.value,
                   help="auto: torch.fx.symbolic_trace, then torch.export, then a module walk (default)")
    g.add_argument("--structure-only", action="store_true",
                   help="build a Hugging Face config on the meta device: counts and shapes, no weights")


def _plan_flags(g: "argparse._ArgumentGroup") -> None:
    """The plan under review and the suggested plan's file."""
    add_shared(g, "plan", "tie")
    g.add_argument("--emit-plan", metavar="FILE", help="write the suggested plan as an editable TOML file")


def _output_flags(g: "argparse._ArgumentGroup") -> None:
    """The report formats, where they go, the baseline and the exit threshold."""
    format_help, output_help = _output_help()
    g.add_argument("--format", default="text", help=format_help)
    g.add_argument("-o", "--output-dir", metavar="DIR", help=output_help)
    g.add_argument("--baseline", metavar="OLD.json", help="report what changed since an earlier JSON audit")
    g.add_argument("--fail-on", choices=[f.value for f in FailOn], help="exit 1 on findings at this level (default error; unmeasured: also when the verdict is "
                        "REVIEW or UNMEASURED, anything but PASS)")
    g.add_argument("-q", "--quiet", action="store_true", help="no terminal table")
    g.add_argument("--width", type=int, metavar="N",
                   help="the text table's line length (at least 60; 0: wide). Default: the terminal's width on a "
                        "terminal ($COLUMNS when set); wide (every column kept) in the .txt report and off a terminal")


def _threshold_flags(g: "argparse._ArgumentGroup") -> None:
    """Settings that override pyproject.toml and the plan's [thresholds]."""
    g.add_argument("--energy", metavar="0.9,0.95,0.99", help="energy targets to report ranks for")
    g.add_argument("--target-energy", type=float, help="energy the suggested rank keeps (default 0.95)")
    g.add_argument("--align", type=int, help="round suggested ranks up to a multiple of this (default 8)")
    g.add_argument("--min-share", type=float, help="layers below this share of parameters are narrow")
    g.add_argument("--energy-floor", type=float, help="LR004 floor (default 0.90)")
    g.add_argument("--select", metavar="CODES", help="only these rules, e.g. LR001,LR004")
    g.add_argument("--ignore", metavar="CODES", help="never these rules")


def _calibration_flags(g: "argparse._ArgumentGroup") -> None:
    """The calibration data, how much of it is read, the metric and its tolerance."""
    add_shared(g, "calibration", "calibration-length", "document-separator")
    g.add_argument("--calibration-max-rows", type=int, metavar="N",
                   help="read at most this many calibration rows (examples, windows; default 100000): more is "
                        "refused, so an endless generator stops")
    g.add_argument("--calibration-max-bytes", metavar="SIZE",
                   help="read at most this much calibration data, e.g. 4G (a file's size, a text file's, the tensors "
                        "a function yields; default 1G)")
    add_shared(g, "holdout", "metric", "tolerance")


def _tier_flags(g: "argparse._ArgumentGroup") -> None:
    """Tiers 2 and 3: measured floors, sensitivity, the verification split, the budget and the recovery."""
    g.add_argument("--measure-floor", action="store_true",
                   help="tier 2: truncate each layer alone and bisect for its measured floor")
    g.add_argument("--no-probe", action="store_true",
                   help="tier 3 without --measure-floor: measure no sensitivity (neither gradients nor probes) and "
                        "cost every layer by its tier-1 layer-output error as it is")
    g.add_argument("--probe", action="store_true",
                   help="tier 3 without --measure-floor: each layer's sensitivity from truncation probes (the layer "
                        "measured alone at two ranks) instead of the default output gradients (one backward pass)")
    add_shared(g, "confidence", "no-split")
    g.add_argument("--budget", type=float, metavar="FRACTION",
                   help="tier 3: a plan removing this share of the parameters, checked all at once")
    g.add_argument("--budget-bytes", metavar="SIZE",
                   help="rank or bits: plan every rewritable weight as kept, int8/int4/int3 (group 128), int4/int3 "
                        "with a low-rank correction, or low-rank factors, so that the model's parameters take at "
                        "most SIZE bytes (e.g. 800M, 1.5G: binary units); measured beside quantization alone, low "
                        "rank alone and uniform int4/int8 and truncation")
    g.add_argument("--bits-per-weight", type=float, metavar="X",
                   help="rank or bits as --budget-bytes, the budget being X bits per weight of the layers it can "
                        "rewrite (the other parameters as they are)")
    g.add_argument("--write-bits", metavar="DIR",
                   help="write the rank-or-bits plan that measured least harm at the budget into DIR (a new "
                        "folder): integer codes, scales and factors in model.safetensors, each layer's choice in "
                        "plan.json; load it with auditor.quantize.written.load_byte_plan")
    from .recovery_flags import add_cli_arguments as recover_arguments

    recover_arguments(g, audit=True)
    g.add_argument("--choose-after-recovery", action="store_true",
                   help="suggest the largest frontier plan that holds the tolerance after the --recover fine-tune "
                        "(marked as needing it); default: the plan that holds before it")


def _device_flags(g: "argparse._ArgumentGroup") -> None:
    """Where and in which dtype calibration statistics are read."""
    g.add_argument("--device", metavar="cpu|cuda|cuda:N|auto",
                   help="where calibration statistics are read (forward and X^T X sums; default: the CPU), and "
                        "where --measure-speed times")
    g.add_argument("--offload", action="store_true",
                   help="keep the weights on the CPU and move each repeated block to --device only while it runs "
                        "(no effect with --device cpu)")
    add_shared(g, "compute-dtype")


def _speed_flags(g: "argparse._ArgumentGroup") -> None:
    """Measured latency and memory."""
    g.add_argument("--measure-speed", action="store_true",
                   help="time each planned layer dense and factorized at the traced input, its time break-even rank, "
                        "and the whole model dense vs factorized (latency, peak memory, a fresh process each), on "
                        "--device (default: the CPU, at torch's thread count)")
    g.add_argument("--latency-shape", metavar="64,128",
                   help="also time the layers at this batch (x positions); implies --measure-speed")
    g.add_argument("--budget-latency", type=float, metavar="FRACTION",
                   help="the plan saving the most parameters whose measured layer times remove this share of the "
                        "dense model's latency; implies --measure-speed")


def _spectra_flags(g: "argparse._ArgumentGroup") -> None:
    """What computes the singular values, the cache, the jobs and the Dask cluster."""
    g.add_argument("--no-spectra", action="store_true", help="skip singular values (structure and counts only)")
    g.add_argument("--spectra-backend", choices=[b.value for b in SpectraBackend], default=SpectraBackend.LAPACK.value,
                   help="what computes the singular values: lapack (CPU float64 Gram + LAPACK, the default), "
                        "torch-cpu or torch-cuda (the same in torch on that device); each keeps its own cache entries")
    add_shared(g, "no-cache")
    g.add_argument("--cache-dir", metavar="DIR", help="spectrum cache (default ~/.cache/lowrank-auditor)")
    g.add_argument("-j", "--jobs", type=int, metavar="N",
                   help="layers computed side by side, each with its share of the cores (default: cores, at most 4)")
    g.add_argument("--scheduler", metavar="ADDR", default=os.environ.get("LOWRANK_AUDITOR_SCHEDULER") or None,
                   help="compute spectra, the calibration's decompositions and --measure-floor sweeps on a Dask "
                        "cluster, e.g. tcp://host:8786 (default $LOWRANK_AUDITOR_SCHEDULER)")
    g.add_argument("--path-map", action="append", default=[], metavar="CLIENT_PREFIX=WORKER_PREFIX",
                   help="the checkpoint's path prefix here and on the Dask workers, which may be an fsspec URL "
                        "such as s3://bucket/dir (repeatable)")


def _common_flags(p: argparse.ArgumentParser) -> None:
    """--version, --verbose and --progress/--no-progress."""
    from .. import __version__

    p.add_argument("--version", action="version", version=f"lowrank-audit {__version__}")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print what torch logged while tracing (FX dumps, warnings) on stderr")
    p.add_argument("--progress", nargs="?", const="always", choices=["never", "auto", "always"], default=None,
                   metavar="never|auto|always",
                   help="progress of each phase (load, trace, spectra, calibration: statistics, tiers 1-3, plan check; "
                        "render) on stderr, never on stdout. auto (the default): a bar on a terminal, else (CI, a log, "
                        "a notebook) a line as each phase starts once the run is 30 s old, a heartbeat at least "
                        "every 30 s, a closing line with counts and time for a calibration phase of 10 s or more; "
                        "always (--progress alone): every phase; never (--no-progress, and -q unless --progress is "
                        "given): nothing")
    p.add_argument("--no-progress", dest="progress", action="store_const", const="never", help=argparse.SUPPRESS)


def _check_stdout(args: argparse.Namespace) -> None:
    """Without -o, stdout carries one document: the table, or the JSON, or the Markdown."""
    from ..render import Stdout, stdout_of

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    kinds = {f: stdout_of(f) for f in dict.fromkeys(formats)}
    to_stdout = [f for f, k in kinds.items() if k in (Stdout.DOCUMENT, Stdout.LOG)
                 or (k is Stdout.TABLE and not args.quiet)]
    documents = [f for f in to_stdout if not kinds[f].shares]  # log lines (table, annotations) may share stdout
    if not args.output_dir and len(to_stdout) > 1 and documents:
        raise AuditError(f"--format {','.join(to_stdout)} would all go to stdout, and {to_stdout[-1]} would not be "
                         "valid there", "Pass -o DIR to write them as files, -q to drop the table, or one format")
    tables = [f for f in to_stdout if kinds[f] is Stdout.TABLE]
    if sys.stdout is None and (to_stdout if not args.output_dir else tables):
        raise AuditError(f"{STDOUT_CLOSED} (>&-), and the {'table' if tables else to_stdout[0]} "
                         "would go there", "Redirect stdout to a file, or pass -q and -o DIR")


def _rules_main(argv: Sequence[str]) -> int:
    from ..rules import RULES, find_rule, rule_doc, rules_markdown
    from ..rules.docs import rule_url
    from ..rules.registry import BUILTIN_ORIGIN

    p = _Parser(prog="lowrank-audit rules", description="List the rules, or print one.")
    p.add_argument("code", nargs="?", help="a rule code such as LR004, or its slug such as energy-below-floor")
    p.add_argument("--markdown", action="store_true", help="print docs/rules.md")
    from ..artifacts.outputs import print_stdout, write_stdout
    from ..render.parts.safe import term

    a = p.parse_args(argv)
    try:
        if a.markdown:
            write_stdout(rules_markdown())
            return 0
        if a.code:
            r = find_rule(a.code)
            url = rule_url(r)
            write_stdout(rule_doc(r) + (f"\nDocumented in {url}\n" if url else "") + "\n")
            return 0
        width = max((len(r.slug) for r in RULES.values()), default=0)
        for r in RULES.values():  # a third-party rule's texts are data: no escape sequence reaches the terminal
            origin = "" if r.origin == BUILTIN_ORIGIN else f" (from {term(str(r.origin))})"
            print_stdout(f"{r.code}  {term(r.slug):<{width}}  {str(r.severity):<8} {term(r.summary)}{origin}")
    except AuditError as exc:
        print(f"error: {exc.line()}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``lowrank-audit MODEL ...``, ``rules`` or ``factorize``. Whatever happens inside, the exit
    code is one of :class:`ExitCode` (or 130 on Ctrl-C): an unexpected exception, a bug of the tool, is one line and
    exit 3 (``--verbose`` adds the traceback), never 1, which CI reads as findings."""
    as_program = argv is None  # the process's own entry point: it ends when this returns
    if as_program:  # the process is the tool's own: process-wide tuning allowed (not when main(argv) is called from a
        own_process()  # host: a notebook, a test run, whose allocator must stay as it was)
    argv = list(sys.argv[1:] if argv is None else argv)
    _reserve_standard_streams()
    verbose = any(a in ("-v", "--verbose") for a in argv)  # known before parsing: a crash anywhere shows it
    written: list[Path] = []
    old = _interrupt_once()
    try:
        code = _dispatch(argv, written)
        if code == 130:  # interrupted, said so by the command itself (factorize)
            _ignore_interrupts()
        return code
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return ExitCode.BAD_INPUT
    except SystemExit:
        raise  # argparse: --help and --version (0)
    except KeyboardInterrupt:
        _ignore_interrupts()
        print(f"interrupted: {'wrote ' + ', '.join(escape(str(w)) for w in written) if written else 'no report written'}",
              file=sys.stderr)
        return 130
    except BrokenPipeError:  # a closed pipe on stderr (2>&1 | head) or a stray print: end quietly, as SIGPIPE would
        from ..artifacts.outputs import silence

        silence(sys.stdout)
        silence(sys.stderr)
        return 128 + 13  # the shell's status for a process ended by SIGPIPE (git log | head under pipefail)
    except PermissionError as exc:  # a folder it may not search, a file it may not read or write: the input's
        where = escape(str(exc.filename)) if exc.filename else "a file it needs"
        print(f"error: permission denied: {where} (lowrank-audit runs as this user). Make it readable (and its "
              "folders searchable), or point at a copy you can read", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except BaseException as exc:  # noqa: BLE001 - a bug: one line and its own exit code, not a traceback and 1
        return internal_error(exc, verbose)
    finally:
        _restore_interrupts(old, keep_ignoring=as_program)


def _on_interrupt(signum: int, frame: object) -> None:
    """The first Ctrl-C: from now on further ones are ignored, so that a second one can neither cut the clean-up
    short (staging folders, worker processes) nor print a traceback (in a ``finally`` or at the process's exit)."""
    _ignore_interrupts()
    raise KeyboardInterrupt


def _ignore_interrupts() -> None:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _interrupt_once() -> object:
    """Install :func:`_on_interrupt` where Ctrl-C would raise KeyboardInterrupt (the main thread, Python's own
    handler: a SIGINT ignored by the shell, as for a background job, stays ignored); the handler it replaced."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    old = signal.getsignal(signal.SIGINT)
    if old is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_interrupt)
    return old


def _restore_interrupts(old: object, keep_ignoring: bool) -> None:
    """Put back the handler :func:`_interrupt_once` replaced; an interrupted program (``keep_ignoring``) keeps
    ignoring Ctrl-C until it has exited (threads joined at exit would otherwise print a traceback)."""
    import signal
    import threading

    if old is None or threading.current_thread() is not threading.main_thread():
        return
    if keep_ignoring and signal.getsignal(signal.SIGINT) is signal.SIG_IGN and old is not signal.SIG_IGN:
        return
    signal.signal(signal.SIGINT, old)  # type: ignore[arg-type]


PROGRESS_WHEN = ("never", "auto", "always")


def _progress_when(args: argparse.Namespace) -> str:
    """--progress's word; unset, ``auto`` (a terminal's bars, a plain log off one), or ``never`` under ``-q``."""
    return getattr(args, "progress", None) or ("never" if getattr(args, "quiet", False) else "auto")


def _progress_alone(argv: list[str]) -> list[str]:
    """``--progress`` not followed by one of its words is ``--progress=always``, so ``--progress MODEL`` keeps MODEL
    as the model (argparse would take it for the word).

    >>> _progress_alone(["--progress", "m.py:f", "--progress", "never"])
    ['--progress=always', 'm.py:f', '--progress', 'never']
    """
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--":
            break
        if a == "--progress" and (i + 1 == len(out) or out[i + 1] not in PROGRESS_WHEN):
            out[i] = "--progress=always"
    return out


def internal_error(exc: BaseException, verbose: bool) -> int:
    """Report an unexpected exception as one line (the traceback before it with ``verbose``); exit code 3."""
    if verbose:
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    hint = "" if verbose else "; rerun with --verbose for the traceback"
    print(f"internal error: {first_line(exc)} (a bug in lowrank-audit, not in the input{hint})", file=sys.stderr)
    return ExitCode.INTERNAL


def _dispatch(argv: list[str], written: list[Path]) -> int:
    if argv and argv[0] == "rules":
        return _rules_main(argv[1:])
    if argv and argv[0] == "check-plan":
        from .plan_command import main as check_plan_main

        return check_plan_main(argv[1:])
    if argv and argv[0] == "factorize":
        from .factorize_command import main as factorize_main

        return factorize_main(argv[1:])
    args = _parser().parse_args(_progress_alone(argv))
    try:
        _check_stdout(args)
        from ..progress import command_run

        with command_run():  # off a terminal, each phase is named as it starts once the run is 30 s old
            return estimate(args) if args.estimate else run(args, written)
    except AuditError as exc:
        captured = getattr(exc, "captured", "")
        if args.verbose and captured:
            print(captured, file=sys.stderr)
        print(f"error: {exc.line()}", file=sys.stderr)
        if "standard output" in exc.what:
            _silence_stdout()
        return ExitCode.BAD_INPUT


STDOUT_CLOSED = "standard output is closed"


def _reserve_standard_streams() -> None:
    """Put /dev/null on descriptors 0-2 that were closed when the process started (``>&-``): otherwise the next file
    the audit opens (a report, a checkpoint) gets descriptor 1, and stdout's writes, or the redirection of user code's
    prints, would land in it. A closed stdout stays ``None`` (the reports meant for it are refused with one line); a
    closed stderr becomes /dev/null, so error lines are dropped rather than written to stdout."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                new = os.open(os.devnull, os.O_RDWR)
                if new != fd:
                    os.dup2(new, fd)
                    os.close(new)
            except OSError:
                pass
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    elif sys.stderr is sys.__stderr__:
        from ..artifacts.outputs import QuietStderr

        sys.stderr = QuietStderr(sys.stderr)  # type: ignore[assignment]


def _silence_stdout() -> None:
    """After stdout failed (a full disk, a closed pipe): point its descriptor at /dev/null, so the interpreter's
    final flush of what is still buffered cannot fail a second time with a traceback-like message."""
    from ..artifacts.outputs import silence

    silence(sys.stdout)


def _path_map(entries: list[str]) -> tuple[tuple[str, str], ...]:
    if not entries:
        return ()
    from ..spectra.dask_executor import parse_path_map  # no distributed import: only the parsing

    return parse_path_map(entries)


def options_from(args: argparse.Namespace) -> tuple["AuditOptions", "LoadOptions"]:
    """The audit's and the loader's options from the flags: defaults < pyproject.toml < the plan < the flags
    (the plan's thresholds are applied between ``settings`` and ``overrides`` by the pipeline)."""
    from ..config import repo_settings
    from ..sources import parse_shape
    from ..options import AuditOptions, LoadOptions

    if args.jobs is not None and args.jobs < 1:
        raise AuditError(f"--jobs {args.jobs}: at least one layer must run", "Pass --jobs 1 or more, or leave it out")
    path_map = _path_map(args.path_map)  # each entry's syntax first, then whether it applies
    if path_map and not args.scheduler:
        raise AuditError("--path-map applies to a Dask cluster, and no --scheduler is given (nor "
                         "$LOWRANK_AUDITOR_SCHEDULER)", "Pass --scheduler tcp://HOST:PORT as well, or drop --path-map")
    if args.scheduler:
        from ..spectra.dask_executor import check_address, env_connect_timeout  # no distributed import: only the parsing

        check_address(args.scheduler)
        env_connect_timeout()
    from ..rules import RULES

    settings, plan_may_relax = repo_settings(RULES.settings())
    overrides = {k: v for k, v in {
        "energy_targets": args.energy, "target_energy": args.target_energy, "align": args.align,
        "min_share": args.min_share, "energy_floor": args.energy_floor, "select": args.select,
        "ignore": args.ignore, "fail_on": args.fail_on,
    }.items() if v is not None}
    cache_dir = _cache_dir(args.cache_dir)
    audit_options = AuditOptions(
        settings=settings, overrides=overrides, overrides_origin="the command line", plan_may_relax=plan_may_relax,
        tracer=Tracer(args.tracer),
        spectra_backend=SpectraBackend(args.spectra_backend), spectra=not args.no_spectra,
        cache=not args.no_cache and cache_usable(cache_dir), cache_dir=cache_dir, jobs=args.jobs,
        progress={"always": True, "never": False}.get(_progress_when(args), "auto"),
        scheduler=args.scheduler, path_map=path_map, ties=tuple(args.tie or ()), **calibration_options(args),
        **speed_options(args),
    )
    load_options = LoadOptions(
        input_shape=tuple(parse_shape(s, "--input-shape") for s in args.input_shape) if args.input_shape else None,
        input_ids=parse_shape(args.input_ids, "--input-ids") if args.input_ids else None,
        weights=args.weights, structure_only=args.structure_only, partial=args.partial,
    )
    return audit_options, load_options


def _device(spec: str) -> str:
    """``--device`` checked before the model loads: an unknown or unavailable device is one line, exit 2."""
    from ..calibration.statistics.stream import resolve_device

    return str(resolve_device(spec))


def _speed_asked(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "measure_speed", False) or getattr(args, "latency_shape", None)
                or getattr(args, "budget_latency", None) is not None)


def speed_options(args: argparse.Namespace) -> dict:
    """--measure-speed, --latency-shape, --budget-latency as AuditOptions fields; --device without calibration is
    where the speed is measured."""
    if not _speed_asked(args):
        return {}
    from ..sources import parse_shape

    out: dict = {"measure_speed": True}
    if args.latency_shape:
        out["latency_shape"] = parse_shape(args.latency_shape, "--latency-shape")
    if args.budget_latency is not None:
        out["budget_latency"] = args.budget_latency
    if args.device is not None and args.calibration is None:
        out["device"] = _device(args.device)
    return out


def _cache_dir(given: str | None) -> Path | None:
    """--cache-dir: a folder (made when missing), never an existing file, FIFO or device."""
    if not given:
        return None
    path = Path(given)
    try:
        is_file = path.exists() and not path.is_dir()
    except OSError:  # EACCES on a folder above it: cache_usable() warns and the run goes on uncached
        return path
    if is_file:
        raise AuditError(f"--cache-dir {given}: not a folder", "Give a folder for the caches (made when missing)")
    return path



def _confidence(level: float) -> float:
    if not (0 < level < 1):
        raise AuditError(f"--confidence {level:g} is not a level in (0, 1)", "Give e.g. --confidence 0.9")
    return float(level)


def calibration_options(args: argparse.Namespace) -> dict:
    """The calibration flags as AuditOptions fields (checked there: --budget in (0, 1), the rest need data)."""
    from ..calibration.data.inputs import parse_size

    recovery = _recovery_options(args)
    if args.calibration is None:
        given = [f for f, v in (("--holdout", args.holdout), ("--metric", args.metric), ("--tolerance", args.tolerance),
                                ("--measure-floor", args.measure_floor or None), ("--budget", args.budget),
                                ("--budget-bytes", args.budget_bytes), ("--bits-per-weight", args.bits_per_weight),
                                ("--write-bits", args.write_bits),
                                ("--no-probe", args.no_probe or None), ("--probe", args.probe or None),
                                ("--confidence", args.confidence), ("--no-split", args.no_split or None),
                                ("--calibration-length", args.calibration_length),
                                ("--document-separator", args.document_separator),
                                ("--calibration-max-rows", args.calibration_max_rows),
                                ("--calibration-max-bytes", args.calibration_max_bytes),
                                ("--device", None if _speed_asked(args) else args.device),
                                ("--offload", args.offload or None),
                                ("--compute-dtype", args.compute_dtype)) if v is not None]
        if given:
            raise AuditError(f"{', '.join(given)} need(s) calibration data", "Pass --calibration FILE as well")
        return {}
    if args.no_split and args.confidence is not None:  # the level is the verification's, and --no-split has none
        raise AuditError(f"--confidence {args.confidence:g} means nothing with --no-split (no rows are kept apart "
                         "to verify on, so no interval is drawn)", "Drop one of --confidence and --no-split")
    return {"calibration": args.calibration, "holdout": args.holdout if args.holdout is not None else 0.25,
            "metric": args.metric, "tolerance": args.tolerance, "measure_floor": args.measure_floor,
            "budget": args.budget, "calibration_length": args.calibration_length,
            **({"budget_bytes": parse_size(args.budget_bytes, "--budget-bytes")} if args.budget_bytes is not None
               else {}),
            **({"bits_per_weight": args.bits_per_weight} if args.bits_per_weight is not None else {}),
            **({"write_bits": args.write_bits} if args.write_bits is not None else {}),
            **({"document_separator": unescape(args.document_separator)} if args.document_separator is not None
               else {}),
            **({"probe_sensitivity": False} if args.no_probe else {}), **({"probe": True} if args.probe else {}),
            **({"confidence": _confidence(args.confidence)} if args.confidence is not None else {}),
            **({"split": False} if args.no_split else {}),
            **({"device": _device(args.device)} if args.device is not None else {}),
            **({"offload": True} if args.offload else {}),
            **({"compute_dtype": args.compute_dtype} if args.compute_dtype not in (None, "model") else {}),
            **({"calibration_max_rows": args.calibration_max_rows} if args.calibration_max_rows is not None else {}),
            **({"calibration_max_bytes": parse_size(args.calibration_max_bytes)}
               if args.calibration_max_bytes is not None else {}), **recovery}


def _recovery_options(args: argparse.Namespace) -> dict:
    """--recover and its flags (those of ``lowrank-audit factorize --recover``) as AuditOptions fields, checked
    before the model loads: each needs the one before it, and --recover needs --calibration and --budget."""
    from .recovery_flags import cli_settings

    if getattr(args, "choose_after_recovery", False) and args.recover is None:
        raise AuditError("--choose-after-recovery needs --recover STEPS: it chooses on the curve measured after "
                         "that fine-tune", "Add --recover 200, say, or drop --choose-after-recovery")
    settings = cli_settings(args)  # --recover-lr without --recover, --recover without --calibration, 0 steps
    if settings is None:
        return {}
    if args.budget is None:
        raise AuditError("--recover needs --budget: it measures the frontier of the budgeted plan search again "
                         "after the fine-tune", "Pass --budget FRACTION as well, e.g. --budget 0.5")
    return {"recover_steps": settings["steps"], "recover_lr": settings["lr"],
            "recover_trainable": settings["trainable"], "recover_objective": settings["objective"],
            "choose_after_recovery": bool(args.choose_after_recovery)}


def _terminal_width(asked: int | None = None) -> int:
    """The on-screen table's width: --width when given, else $COLUMNS when set, else the terminal's width when
    stdout is a terminal, else 0: wide (a pipe or a CI log keeps every column and every name whole)."""
    import shutil

    if asked is not None:
        return asked
    if os.environ.get("COLUMNS", "").strip().isdigit():
        return int(os.environ["COLUMNS"])
    try:
        tty = sys.stdout.isatty()
    except (AttributeError, ValueError):
        tty = False
    return shutil.get_terminal_size((100, 24)).columns if tty else 0


def _destinations(args: argparse.Namespace, formats: list[str]) -> dict[str, Path]:
    """The file each file-bound format goes to, and ``plan`` for --emit-plan; every one checked before the audit:
    -o must be (or become) a writable folder, nothing but a regular file is ever replaced, --emit-plan may not
    name the plan under review or a report."""
    from ..artifacts.outputs import check_destination, check_folder, check_not_input, same_file
    from ..render import REPORTERS, Stdout, stdout_of

    dest: dict[str, Path] = {}
    inputs = run_inputs(args)
    out_dir = Path(args.output_dir) if args.output_dir else None
    if out_dir is not None:
        check_folder(out_dir, "-o")
        bits = getattr(args, "write_bits", None)
        if bits and os.path.abspath(bits) == os.path.abspath(out_dir):
            raise AuditError(f"--write-bits {bits} is the reports' folder -o", "Write the byte plan into its own folder")
        if os.path.islink(out_dir):  # followed, but never silently (the GitHub Action refuses one outright)
            print(f"note: -o {escape(str(out_dir))} is a symbolic link: the reports go to "
                  f"{escape(str(out_dir.resolve()))}", file=sys.stderr)
    for fmt in formats:
        kind = stdout_of(fmt)
        if kind is Stdout.LOG or (out_dir is None and kind in (Stdout.TABLE, Stdout.DOCUMENT)):
            continue
        dest[fmt] = (out_dir or Path(".")) / f"lowrank-audit{REPORTERS[fmt].suffix}"
        check_destination(dest[fmt], f"--format {fmt}: report")
        if args.plan and same_file(args.plan, dest[fmt]):
            raise AuditError(f"the {fmt} report {dest[fmt]} would replace the plan under review",
                             "Pass -o another folder, or move the plan")
        # the one exception: the JSON report may advance the --baseline it was compared with (a ratchet in CI)
        check_not_input(dest[fmt], f"the {fmt} report", [i for i in inputs if fmt != "json" or i[0] != "--baseline"])
    if args.emit_plan:
        if args.emit_plan == "-":  # not stdout: that carries the reports
            raise AuditError("--emit-plan - would write a file named '-', not to standard output",
                             "Give the plan a file path (./- for a file named '-')")
        plan_path = Path(args.emit_plan)
        if args.plan and same_file(args.plan, plan_path):
            raise AuditError(f"--emit-plan {plan_path} is the plan under review (--plan {args.plan})",
                             "Write the suggested plan to another file")
        for fmt, report in dest.items():
            if same_file(report, plan_path):
                raise AuditError(f"--emit-plan {plan_path} is also the {fmt} report", "Choose another file")
        check_not_input(plan_path, "--emit-plan", inputs)
        check_destination(plan_path, "--emit-plan")
        dest["plan"] = plan_path
    return dest


def run_inputs(args: argparse.Namespace) -> list[tuple[str, str | Path | None]]:
    """Every file or folder the run reads, as (label, value given): no output may replace one of them."""
    from ..config import nearest_pyproject

    metric = getattr(args, "metric", None)
    return [("the model source", args.model), ("--weights", getattr(args, "weights", None)),
            ("the plan under review", getattr(args, "plan", None)),
            ("--calibration", getattr(args, "calibration", None)), ("--holdout", getattr(args, "holdout", None)),
            ("--metric", metric if metric and ":" in metric else None),
            ("--baseline", getattr(args, "baseline", None)), ("the settings file", nearest_pyproject())]


def _formats(args: argparse.Namespace) -> list[str]:
    """--format's list, each a known reporter, at most one document for stdout; --width checked with them."""
    from ..render import REPORTERS, Stdout, stdout_of

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    bad = [f for f in formats if f not in REPORTERS]
    if bad:
        raise AuditError(f"unknown format {', '.join(bad)}", f"Choose from {', '.join(REPORTERS)}")
    documents = [f for f in dict.fromkeys(formats) if stdout_of(f) is Stdout.DOCUMENT]
    if not args.output_dir and len(documents) > 1:
        raise AuditError(f"{' and '.join(documents)} cannot all go to stdout", "Pass -o DIR to write them as files")
    if getattr(args, "width", None) is not None and args.width < 0:
        raise AuditError(f"--width {args.width} is negative", "Pass 0 for a wide table, or a line length of 60 or more")
    return formats


def estimate(args: argparse.Namespace) -> int:
    """--estimate: what the audit would cost (auditor/speed/estimate.py), the table (or ``{"estimate": ...}`` with
    --format json) on stdout; the flags checked as for the audit, then no audit runs and no file is written."""
    from .. import pipeline  # noqa: F401  (imported as the audit's run imports it: the process's base memory)
    from ..speed.estimate import estimate_source, render

    formats = tuple(_formats(args))
    options, load_options = options_from(args)
    sys.stdout.write(render(estimate_source(args.model, options, load_options, formats), formats))
    return ExitCode.OK


def run(args: argparse.Namespace, written: list[Path] | None = None) -> int:
    """The audit the flags ask for. Outputs are all or nothing (:mod:`auditor.artifacts.outputs`); ``written`` receives the
    paths once they are all in place (the interrupt message says exactly what exists)."""
    from ..verdict import baseline as baseline_mod
    from ..artifacts.outputs import OutputSet, write_stdout
    from ..pipeline import audit_source, render_reports
    from ..planning.plan import emit_toml
    from ..verdict.policy import exit_code, input_errors
    from ..render import REPORTERS, RenderContext, Stdout, stdout_of

    formats = _formats(args)
    options, load_options = options_from(args)
    dest = _destinations(args, formats)
    base = baseline_mod.load(args.baseline) if args.baseline else None

    result = audit_source(args.model, plan=args.plan, options=options, load=load_options)
    if getattr(args, "verbose", False) and result.trace_log:
        print(result.trace_log, file=sys.stderr)
    for f in input_errors(result):
        raise AuditError(f"{f.code} {f.message}", f.fix)

    # Render everything first; then write all files or none, and stdout last (a failure there undoes the files).
    from dataclasses import replace

    width = getattr(args, "width", None)
    context = RenderContext(baseline=baseline_mod.compare(result, base) if base is not None else None,
                            width=_terminal_width(width), baseline_report=base)
    table = {f for f in formats if stdout_of(f) is Stdout.TABLE}
    ordered = sorted(dict.fromkeys(formats), key=lambda f: f not in table)  # the table first, as before
    from ..progress import Progress

    outputs = render_reports(result, [f for f in ordered if f not in table or not args.quiet or f in dest], context,
                             Progress(enabled=options.progress))
    files = OutputSet(written=written if written is not None else [])
    for fmt, content in outputs.items():
        if fmt in table and fmt in dest and context.width != (width or 0):  # the .txt report: wide unless --width
            content = REPORTERS[fmt].render(result, replace(context, width=width or 0))
        if fmt in dest:
            files.add(dest[fmt], content)
    if "plan" in dest:
        files.add(dest["plan"], emit_toml(result))
    from ..render.terminal import colour, use_colour

    to_stdout = [colour(content) if fmt in table and isinstance(content, str) and use_colour(sys.stdout) else content
                 for fmt, content in outputs.items()
                 if fmt not in dest or (fmt in table and not args.quiet)]  # the table: on screen and in -o

    if args.quiet and not to_stdout:  # -q keeps the verdict line, and a failing run's findings
        from ..verdict.policy import quiet_lines

        to_stdout.append(quiet_lines(result))

    def stdout() -> None:
        for content in to_stdout:
            write_stdout(content)

    for path in files.commit(after=stdout):
        print(f"wrote {escape(str(path))}", file=sys.stderr)
    return exit_code(result)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
