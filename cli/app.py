"""The busctl command line. Every command builds its settings once (file < env < flags) and calls
into libbus/services; errors print one line and exit non-zero. This module builds the app, registers
the commands that live in their own modules (cli/start.py, cli/jobs.py, cli/tokens.py, cli/studies.py)
and holds the small ones."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from libbus.config import Settings, load_settings
from services import views

from . import tables
from .connection import admin_client
from .jobs import job_app, jobs, submit
from .options import Config, Json, StateDir, admin_options
from .output import fail, guard, print_json
from .start import start_app
from .studies import studies, study_app
from .tokens import keys_app, token_app
from .units import install_units
from .web import web

app = typer.Typer(
    name="busctl",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # -h as well as --help, on every command and subcommand (click's contexts inherit it)
    context_settings={"help_option_names": ["-h", "--help"]},
    help="batchbus: stream training data to PyTorch trainers. (Not systemd's busctl: "
    "this one lives in the project's environment.)",
)
config_app = typer.Typer(no_args_is_help=True, help="Show the effective settings.")
shm_app = typer.Typer(no_args_is_help=True, help="Shared-memory rings on this host.")
app.add_typer(start_app, name="start")
app.add_typer(job_app, name="job")
app.add_typer(token_app, name="token")
app.add_typer(config_app, name="config")
app.add_typer(shm_app, name="shm")
app.add_typer(keys_app, name="keys")
app.add_typer(study_app, name="study")
app.command("studies")(studies)
app.command("install-units")(guard(install_units))
app.command("web")(web)


@app.command()
@guard
def demo(
    epochs: Annotated[int, typer.Option(help="Epochs to train.")] = 2,
    dataset: Annotated[str, typer.Option(help="Dataset URI the demo provider serves.")] = "mock://mnist",
    model: Annotated[str, typer.Option(help="mlp or cnn.")] = "cnn",
    state_dir: StateDir = None,
) -> None:
    """Router + provider + trainer on localhost; trains a CNN on mock MNIST and scores it on the provider."""
    from .demo import run_demo

    run_demo(epochs=epochs, uri=dataset, model=model, state_dir=state_dir)


# -h goes to the benchmark's own parser (it lists the benchmark's options); --help shows this page
@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": ["--help"]}
)
@guard
def bench(ctx: typer.Context) -> None:
    """Same-host delivery benchmark: shm ring vs socket vs DataLoader vs raw pyzmq vs memcpy.

    ``--peers``: the same samples and batches through torch's DataLoader, MosaicML Streaming,
    Lightning litData, WebDataset and torchdata.nodes beside batchbus (``make install-bench``);
    ``--workload images`` decodes and augments JPEGs in every row (``--image-size``, ``--image-side``).
    ``--remote``: data behind a network: a loopback store answering each request after 0-100 ms, read
    by a provider as ``http://`` and ``s3://`` beside MosaicML Streaming (``--htb``: a capped link).

    Options are the benchmark's own (``busctl bench -h`` lists them); ``--json FILE``
    writes the results.
    """
    args = list(ctx.args)
    if "--remote" in args:  # data behind a network: a store with per-request latency, a capped link
        from benchmarks import remote

        args.remove("--remote")
        raise typer.Exit(remote.main(args))
    if "--peers" in args:  # the same samples through MosaicML Streaming, litData, WebDataset, torchdata
        from benchmarks.peers import main as bench_main
    else:
        from benchmarks.delivery import main as bench_main

    bench_main(args)


# -- jobs (cli/jobs.py) --------------------------------------------------------------------------

app.command()(submit)
app.command()(jobs)


# -- cluster -------------------------------------------------------------------------------------


@app.command()
@guard
@admin_options
def queues(*, settings: Settings, json: Json = False) -> None:
    """Every service's queue and traffic metrics, as carried on heartbeats."""
    s = settings
    with admin_client(s) as client:
        services = views.stats(client)
    print_json(services) if json else tables.queues(services)


@app.command()
@guard
@admin_options
def top(
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")] = 2.0,
    once: Annotated[
        bool, typer.Option("--once", help="Print one frame (two snapshots --interval apart) and exit.")
    ] = False,
    *,
    settings: Settings,
    json: Annotated[bool, typer.Option("--json", help="With --once: the frame's data.")] = False,
) -> None:
    """A live view of providers, trainers, jobs and pipeline stages until Ctrl-C (docs/operations.md)."""
    from .top import top_command

    if json and not once:
        fail("--json prints one frame: use it with --once", 2)
    top_command(settings, interval=interval, once=once, json=json)


@app.command()
@guard
@admin_options
def control(
    provider: Annotated[str, typer.Argument(help="Provider name (busctl peers).")],
    stage: Annotated[str, typer.Argument(help="A stage of one of its pipeline datasets.")],
    command: Annotated[str, typer.Argument(help="stats; random stages also get, set, reset.")],
    args: Annotated[list[str] | None, typer.Argument(help="key=value, e.g. seed=3 epoch=2 (set).")] = None,
    dataset: Annotated[str, typer.Option(help="The pipeline dataset, when several have STAGE.")] = "",
    *,
    settings: Settings,
    json: Json = False,
) -> None:
    """Send a control command to one stage of a provider's pipeline dataset (docs/operations.md)."""
    from .pipeline import control_command

    control_command(settings, provider, stage, command, args or [], dataset=dataset, json=json)


@app.command()
@guard
@admin_options
def peers(*, settings: Settings, json: Json = False) -> None:
    """Providers, trainers and admins connected to the router."""
    s = settings
    with admin_client(s) as client:
        rows = views.peers(client)
    print_json(rows) if json else tables.peers(rows)


@app.command("datasets")
@guard
@admin_options
def datasets(*, settings: Settings, json: Json = False) -> None:
    """Every dataset the providers serve: providers, kind, splits, sample shape and dtype, classes."""
    from .data import datasets_command

    datasets_command(settings, json=json)


@app.command("fetch")
@guard
@admin_options
def fetch(
    dataset: Annotated[str, typer.Argument(help="Dataset name (or remote://NAME).")],
    split: Annotated[str, typer.Option(help="train or val (test never leaves its provider).")] = "train",
    indices: Annotated[
        str,
        typer.Option(
            help="Ranges START:STOP[:STEP] such as 0:8 or 0:64:4, single indices, comma-joined: 3,7,9 or 0:4,100."
        ),
    ] = "0:8",
    out: Annotated[
        Path | None, typer.Option(help="Save instead of printing: .npz (x, y, indices) or .npy (x only).")
    ] = None,
    epoch: Annotated[int, typer.Option(min=0, help="The epoch whose augmentations a pipeline dataset applies.")] = 0,
    *,
    settings: Settings,
    json: Json = False,
) -> None:
    """Samples of a dataset exactly as a trainer receives them: shape, dtype, labels, per-sample summary."""
    from .data import fetch_command

    fetch_command(settings, dataset, split, indices, out=out, json=json, epoch=epoch)


@shm_app.command("ls")
@guard
def shm_ls(json: Json = False) -> None:
    """Every batchbus ring in /dev/shm: owner pid, whether it still runs, size."""
    from shm import list_segments

    rows = [seg.as_dict() for seg in list_segments()]
    print_json(rows) if json else tables.segments(rows)


@shm_app.command("gc")
@guard
def shm_gc(json: Json = False) -> None:
    """Remove rings whose owner is gone (a killed trainer's). Rings of live processes stay."""
    from shm import collect_garbage

    rows = [seg.as_dict() for seg in collect_garbage()]
    if json:
        print_json(rows)
    else:
        total = sum(r["size"] for r in rows)
        typer.echo(
            f"removed {len(rows)} ring(s), {total / 2**20:.1f} MiB"
            + "".join(f"\n  {r['name']} (pid {r['pid']})" for r in rows)
        )


@config_app.command("show")
@guard
def config_show(config: Config = None, json: Json = False) -> None:
    """Every setting, its effective value and where that value came from."""
    settings, sources = load_settings(config_file=config)
    values = settings.redacted()  # a token is a password: never printed
    if json:
        print_json({k: {"value": v, "source": sources[k]} for k, v in values.items()})
    else:
        tables.settings(values, sources)


def main() -> None:
    app()
