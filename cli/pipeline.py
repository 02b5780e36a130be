"""``busctl control``: send a control command to one stage of a provider's pipeline dataset.

The command goes straight to the provider's data endpoint (found with ``ListPeers`` at the router),
as ``busctl fetch`` does for samples: the router never carries it, so it works while the router
only knows the provider's address. The provider checks the admin token like any other request.
"""

from __future__ import annotations

from libbus.config import Settings
from libbus.connect.client import Client
from libbus.errors import NotFound
from libbus.wire.messages import ListPeers, StageControl

from .connection import admin_client
from .output import SafeConsole, fail, print_json

__all__ = ["control_command", "parse_args"]

console = SafeConsole(markup=False, emoji=False, highlight=False, soft_wrap=True)


def parse_args(pairs: list[str]) -> dict:
    """``["seed=3", "epoch=request"]`` → ``{"seed": 3, "epoch": "request"}`` (integers as int).

    Raises ``ValueError`` naming a piece that is not ``key=value``.
    """
    args: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{pair!r} is not key=value (e.g. seed=3)")
        try:
            args[key] = int(value)
        except ValueError:
            args[key] = value
    return args


def control_command(
    settings: Settings, provider: str, stage: str, command: str, pairs: list[str], dataset: str = "", json: bool = False
) -> None:
    """Send ``command`` with ``pairs`` to ``stage`` on ``provider``; print the stage's answer."""
    try:
        args = parse_args(pairs)
    except ValueError as err:
        fail(str(err), 2)
    with admin_client(settings) as router:
        peers = router.request(ListPeers()).peers
        identity = router.identity
    providers = {p["name"]: p for p in peers if p["role"] == "provider"}
    if provider not in providers:
        raise NotFound(
            f"no provider named {provider!r} is connected; providers: "
            f"{', '.join(sorted(providers)) or 'none'} (busctl peers)"
        )
    with Client(
        providers[provider]["endpoint"],
        identity,
        timeout_s=settings.request_timeout_s,
        retries=settings.request_retries,
    ) as client:
        detail = client.request(StageControl(stage=stage, command=command, dataset=dataset, args=args)).detail
    if json:
        print_json(detail)
        return
    answers = detail["result"] if detail["stage"] == "*" else {detail["stage"]: detail["result"]}
    for stage, answer in answers.items():
        console.print(f"{provider} {detail['dataset']}/{stage} {command}:")
        for key, value in answer.items():
            console.print(f"  {key:<20} {value}")
