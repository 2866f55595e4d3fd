"""``trainguard checkpoint ...``: inspect, verify and convert checkpoints.

Importing this module does not import torch (the CLI starts fast and ``inspect`` works
without it); commands that need tensors import it when they run. Errors are one line on
stderr: exit status 2 when the command cannot run (bad arguments, no checkpoint), 1 when
``verify`` ran and found damage.
"""

from __future__ import annotations

import contextlib
import json
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from checkpoint._store import CheckpointReader, CheckpointStore, PassedOver, verify_latest
from checkpoint._tier_restore import tier_rows
from checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
)
from checkpoint.manifest import Manifest

app = typer.Typer(
    name="checkpoint",
    help="Inspect, verify and convert trainguard checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class Output(StrEnum):
    table = "table"
    json = "json"


class ConvertFormat(StrEnum):
    universal = "universal"
    safetensors = "safetensors"
    dcp = "dcp"


class ImportFormat(StrEnum):
    safetensors = "safetensors"
    dcp = "dcp"


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _age(unix_s: float) -> str:
    secs = max(0, int(time.time() - unix_s))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{secs // size}{unit}"
    return f"{secs}s"


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{nbytes}B"  # pragma: no cover


def _table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    for row in [headers, *rows]:
        typer.echo("   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _need_dir(path: Path) -> None:
    """A checkpoint root must be a directory; say which of the two ways it is not."""
    if not path.is_dir():
        raise _fail(f"{path}: " + ("not a directory" if path.exists() else "no such directory"))


@app.command("inspect")
def inspect_cmd(
    root: Annotated[Path, typer.Argument(help="Checkpoint directory (holds step-* folders)")],
    step: Annotated[int | None, typer.Option(help="Show this checkpoint's tensors")] = None,
    output: Annotated[Output, typer.Option("-o", "--output")] = Output.table,
) -> None:
    """List checkpoints, or the tensors of one (no torch needed)."""
    _need_dir(root)
    store = CheckpointStore(root)
    try:
        if step is None:
            _list(store, output)
        else:
            with store.open(step) as reader:
                _tensors(reader, output)
    except CheckpointError as exc:
        raise _fail(str(exc)) from None


def _list(store: CheckpointStore, output: Output) -> None:
    rows: list[dict[str, Any]] = []
    pointer = None
    with contextlib.suppress(CheckpointError):
        pointer = store.latest_pointer()
    for info in store.list():
        row: dict[str, Any] = {
            "step": info.step,
            "complete": info.complete,
            "world": None,
            "size_bytes": None,
            "created_unix_s": None,
            "latest": info.step == pointer,
            "problem": info.problem,
        }
        if info.complete:
            try:
                with store.open(info.step) as reader:
                    m = reader.manifest
                    row.update(
                        world=m.world_size,
                        size_bytes=m.total_bytes,
                        created_unix_s=m.created_unix_s,
                        layout=m.layout,
                    )
            except CheckpointError as exc:
                row.update(complete=False, problem=str(exc))
        rows.append(row)
    # The object-storage tier as this node's uploader journaled it (no network needed).
    remote = tier_rows(store.root)
    for row in rows:
        row["object_store"] = remote.get(row["step"], "-")
    for step in sorted(set(remote) - {r["step"] for r in rows}):  # only in the bucket now
        rows.append(
            {
                "step": step,
                "complete": False,
                "world": None,
                "size_bytes": None,
                "created_unix_s": None,
                "latest": False,
                "problem": "no local copy",
                "object_store": remote[step],
            }
        )
    abandoned = store.abandoned()
    if output == Output.json:
        typer.echo(
            json.dumps({"root": str(store.root), "checkpoints": rows, "abandoned": abandoned})
        )
        return
    headers = ["STEP", "STATUS", "WORLD", "SIZE", "AGE", "LATEST"]
    if remote:  # the column only where an object-storage tier has been used
        headers.append("OBJECT STORE")
    _table(
        headers,
        [
            [
                str(r["step"]),
                "complete"
                if r["complete"]
                else ("-" if r["problem"] == "no local copy" else "partial"),
                str(r["world"]) if r["world"] else "-",
                _size(r["size_bytes"]) if r["size_bytes"] is not None else "-",
                _age(r["created_unix_s"]) if r["created_unix_s"] else "-",
                "*" if r["latest"] else "-",
            ]
            + ([r["object_store"]] if remote else [])
            for r in rows
        ],
    )
    if abandoned:  # kept for forensics; says why a step seems to be missing
        typer.echo(
            f"set aside in {store.abandoned_root} (never loaded): "
            f"steps {', '.join(map(str, abandoned))}"
        )


def _tensors(reader: CheckpointReader, output: Output) -> None:
    rows: list[dict[str, Any]] = []
    for rank in range(reader.manifest.world_size):
        for e in reader.entries(rank):
            g = e.global_map
            rows.append(
                {
                    "rank": rank,
                    "name": e.name,
                    "dtype": e.dtype,
                    "shape": e.shape,
                    "size_bytes": e.nbytes,
                    "global_shape": g.shape if g else None,
                    "placement": g.placement if g else None,
                    "offsets": [p.offsets for p in g.pieces] if g else None,
                }
            )
    if output == Output.json:
        typer.echo(
            json.dumps(
                {
                    "step": reader.step,
                    "world_size": reader.manifest.world_size,
                    "layout": reader.manifest.layout,
                    "tensors": rows,
                }
            )
        )
        return
    _table(
        ["RANK", "NAME", "DTYPE", "SHAPE", "SIZE", "GLOBAL", "PLACEMENT"],
        [
            [
                str(r["rank"]),
                r["name"],
                r["dtype"],
                "x".join(map(str, r["shape"])) or "()",
                _size(r["size_bytes"]),
                "x".join(map(str, r["global_shape"])) if r["global_shape"] is not None else "-",
                r["placement"] or "-",
            ]
            for r in rows
        ],
    )


@app.command("verify")
def verify_cmd(
    root: Annotated[Path, typer.Argument(help="Checkpoint directory")],
    step: Annotated[
        int | None,
        typer.Option(help="Default: the step load() resumes from ('latest' is a hint)"),
    ] = None,
    quick: Annotated[bool, typer.Option(help="Check manifests and sizes only")] = False,
) -> None:
    """Re-read every byte and check it against the recorded CRCs and SHA-256, and each
    rank's state skeleton against its manifest as load() does (no torch needed).

    Without --step: the checkpoint a restart would resume from, found as load() finds it
    (newest committed first, 'latest' only a hint); a damaged newer one is reported and
    skipped, and makes the exit status 1 even when an older one verifies.
    """
    _need_dir(root)
    store = CheckpointStore(root)
    passed = PassedOver()
    try:
        if step is not None:
            with store.open(step) as reader:
                reader.verify(deep=not quick)
                m = reader.manifest
        else:
            m = _verify_resume_step(store, deep=not quick, passed=passed)
    except (CheckpointCorruptError, CheckpointIncompleteError) as exc:
        raise _fail(str(exc), code=1) from None
    except CheckpointError as exc:
        raise _fail(str(exc)) from None
    damage = passed.lines()
    if passed.latest_damaged:
        damage.insert(0, passed.latest_note)
    for problem in damage:
        typer.echo(f"error: {problem}", err=True)
    what = "manifests and sizes" if quick else f"{_size(m.total_bytes)} re-read"
    if passed.steps:
        skipped = ", ".join(map(str, passed.steps))
        what += f"; load() resumes from it, skipping damaged step(s) {skipped}"
    typer.echo(f"ok: step {m.step}, {m.world_size} rank(s), {what}")
    if damage:
        raise typer.Exit(1)


def _verify_resume_step(store: CheckpointStore, *, deep: bool, passed: PassedOver) -> Manifest:
    """:func:`verify_latest`, saying first on stderr a note on ``latest`` that is not damage.

    Each damaged newer step is damage, and so is a ``latest`` holding garbage (the writer
    replaces it atomically); a pointer that lags or names a step whose save never committed
    (a crash mid-save) is only noted, even when nothing verifies.
    """
    try:
        return verify_latest(store, deep=deep, passed=passed)
    finally:
        if passed.latest_note and not passed.latest_damaged:
            typer.echo(f"note: {passed.latest_note}", err=True)


@app.command("convert")
def convert_cmd(
    src: Annotated[Path, typer.Argument(help="Checkpoint directory to read")],
    out: Annotated[Path, typer.Argument(help="Directory (universal, dcp) or file to write")],
    to: Annotated[ConvertFormat, typer.Option(help="Output form")] = ConvertFormat.universal,
    step: Annotated[
        int | None,
        typer.Option(help="Default: the step load() resumes from, verified (said which)"),
    ] = None,
    check: Annotated[bool, typer.Option(help="Check replicated copies are equal")] = True,
) -> None:
    """Consolidate a sharded checkpoint into one tensor per parameter.

    Never writes over a checkpoint: OUT must not be SRC, nor hold the step or a newer one.
    Damage found in SRC exits 1, as verify does.
    """
    _need_dir(src)
    from checkpoint import _convert as convert

    fn = {
        ConvertFormat.universal: convert.to_universal,
        ConvertFormat.safetensors: convert.to_safetensors,
        ConvertFormat.dcp: convert.to_dcp,
    }[to]
    try:
        done = fn(src, out, step=step, check=check)
    except (CheckpointCorruptError, CheckpointIncompleteError) as exc:
        raise _fail(str(exc), code=1) from None  # damage, as verify reports it
    except CheckpointError as exc:
        raise _fail(str(exc)) from None
    if done.latest_note:
        typer.echo(f"note: {done.latest_note}", err=True)
    skipped = f"; skipped newer {'; '.join(done.skipped)}" if done.skipped else ""
    typer.echo(f"wrote {out} ({to.value}, {_size(done.size_bytes)}) from step {done.step}{skipped}")


@app.command("import")
def import_cmd(
    src: Annotated[Path, typer.Argument(help="safetensors file or DCP directory")],
    out: Annotated[Path, typer.Argument(help="Checkpoint directory to create")],
    source: Annotated[ImportFormat, typer.Option("--from", help="Input format")],
    step: Annotated[int, typer.Option(help="Step number to record")] = 0,
) -> None:
    """Bring a safetensors file or a torch.distributed.checkpoint directory in.

    OUT may be new or hold only older steps: an existing step is never replaced, and
    'latest' never moves back (exit 2).
    """
    if not src.exists():
        raise _fail(f"{src}: no such file or directory")
    from checkpoint import _convert as convert

    try:
        if source == ImportFormat.safetensors:
            written = convert.from_safetensors(src, out, step=step)
        else:
            written = convert.from_dcp(src, out, step=step)
    except CheckpointError as exc:
        raise _fail(str(exc)) from None
    except Exception as exc:  # a foreign file we cannot parse: one line, not a traceback
        raise _fail(f"{src}: cannot read as {source.value} ({type(exc).__name__}: {exc})") from None
    typer.echo(f"wrote {out} (step {step}, {_size(written)})")


def main(argv: list[str] | None = None) -> int:
    """``python -m checkpoint.cli``: as ``trainguard checkpoint``, a bad argument is one
    ``error:`` line and exit 2, not typer's usage panel."""
    prog = "trainguard checkpoint"
    try:
        result = typer.main.get_command(app).main(args=argv, prog_name=prog, standalone_mode=False)
    except typer.TyperException as exc:
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
            typer.echo(ctx.get_help())
            return 0
        where = getattr(ctx, "command_path", None) or prog
        message = " ".join(exc.format_message().split())
        typer.echo(f"error: {message} (see '{where} --help')", err=True)
        return int(getattr(exc, "exit_code", 1))
    except typer.Exit as exc:
        return int(exc.exit_code)
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        return 130
    return result if isinstance(result, int) else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
