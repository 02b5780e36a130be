"""``busctl token …`` (mint, inspect, revoke tokens; the cluster secret and signing key) and
``busctl keys …`` (CURVE key pairs)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from libbus.config import Settings
from libbus.errors import BusError, ConfigError
from libbus.security.auth import ROLES, ensure_secret

from . import tables
from .connection import admin_client, settings_from
from .options import Config, Json, SecretFile, StateDir, admin_options
from .output import fail, guard, print_json

__all__ = ["token_app", "keys_app"]

#: The roles ``busctl token node`` gives a node (an admin's token is a person's: ``token issue``).
NODE_ROLES = ("provider", "trainer", "reader")
#: A node token's default lifetime: 90 days (a service cannot renew its own; revoke one with
#: ``busctl token revoke``).
NODE_TTL_S = 90 * 86400.0

token_app = typer.Typer(no_args_is_help=True, help="Mint and inspect tokens; create the cluster secret or signing key.")
keys_app = typer.Typer(
    no_args_is_help=True, help="CURVE key pairs: encrypted, key-authenticated connections (docs/security.md)."
)


@token_app.command("issue")
@guard
def token_issue(
    role: Annotated[str, typer.Option(help=f"One of {', '.join(ROLES)}.")],
    name: Annotated[str, typer.Option(help="The token's subject.")] = "",
    ttl: Annotated[float, typer.Option(help="Lifetime in seconds.")] = 24 * 3600.0,
    dataset: Annotated[
        list[str] | None,
        typer.Option("--dataset", help="Restrict the token to this dataset (repeatable; default: all)."),
    ] = None,
    job: Annotated[
        list[str] | None, typer.Option("--job", help="Restrict the token to this job id (repeatable; default: all).")
    ] = None,
    alg: Annotated[str | None, typer.Option("--alg", help="HS256 or EdDSA (default: token_alg setting).")] = None,
    issuer: Annotated[
        str | None, typer.Option("--issuer", help="The iss claim (default: token_issuer, else the cluster).")
    ] = None,
    signing_key_file: Annotated[
        str | None, typer.Option("--signing-key-file", help="EdDSA signing key (or BATCHBUS_SIGNING_KEY_FILE).")
    ] = None,
    config: Config = None,
    secret_file: SecretFile = None,
    state_dir: StateDir = None,
) -> None:
    """Print a signed token for ROLE: from the cluster secret (HS256) or the signing key (EdDSA)."""
    from services.credentials import mint_token, signing_key
    from services.router.grants import LONGEST_TOKEN_S

    if ttl > LONGEST_TOKEN_S:  # a revocation lasts at most this long (docs/security.md §5)
        fail(f"--ttl is at most {LONGEST_TOKEN_S:.0f} s ({LONGEST_TOKEN_S / 86400:.0f} days), got {ttl:g}", 2)

    s = settings_from(
        config,
        secret_file=secret_file,
        state_dir=state_dir,
        token_alg=alg,
        token_issuer=issuer,
        signing_key_file=signing_key_file,
    )
    typer.echo(
        mint_token(
            s, signing_key(s), role=role, sub=name or role, ttl_s=ttl, datasets=dataset or None, jobs=job or None
        )
    )


@token_app.command("inspect")
@guard
def token_inspect(
    token: Annotated[str, typer.Argument(help="The token to show ('-' reads it from stdin).")],
    config: Config = None,
    secret_file: SecretFile = None,
    state_dir: StateDir = None,
    public_key_file: Annotated[
        str | None, typer.Option("--public-key-file", help="EdDSA public key (or BATCHBUS_PUBLIC_KEY_FILE).")
    ] = None,
    alg: Annotated[
        str | None, typer.Option("--alg", help="Verify as HS256 or EdDSA (default: token_alg setting).")
    ] = None,
    json: Json = False,
) -> None:
    """Print a token's claims: verified with this node's key where it has one, else marked UNVERIFIED."""
    import sys
    import time

    from libbus.security.auth import inspect_token, verify_token
    from services.credentials import verify_key

    if token == "-":
        token = sys.stdin.read().strip()
    s = settings_from(
        config, secret_file=secret_file, state_dir=state_dir, public_key_file=public_key_file, token_alg=alg
    )
    header, claims = inspect_token(token)
    try:
        key = verify_key(s)
    except ConfigError as err:
        status, detail = "UNVERIFIED", f"no {s.token_alg} key here ({err})"
    else:
        try:
            verify_token(token, key, audience=s.cluster, issuer=s.token_issuer, algorithm=s.token_alg)
            status, detail = "VERIFIED", f"{s.token_alg} signature, audience, issuer and lifetime check out"
        except BusError as err:
            status, detail = "INVALID", f"{err} [{err.code}]"
    if json:
        print_json({"status": status, "detail": detail, "header": header, "claims": claims})
    else:
        typer.echo(f"{status}: {detail}")
        typer.echo(f"  alg: {header.get('alg')}")
        for key_name, value in claims.items():
            if key_name in ("iat", "nbf", "exp") and isinstance(value, (int, float)):
                value = f"{value} ({time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(value))})"
            typer.echo(f"  {key_name}: {value}")
    if status == "INVALID":
        raise typer.Exit(1)


@token_app.command("revoke")
@guard
@admin_options
def token_revoke(
    what: Annotated[str, typer.Argument(help="The token to revoke ('-' reads it from stdin), or its bare jti.")],
    reason: Annotated[str, typer.Option(help="Why: kept with the revocation.")] = "",
    keep: Annotated[
        float | None,
        typer.Option(
            "--keep",
            help="For a bare jti: seconds to keep refusing it (default: token_ttl_s). A whole token is refused until it expires.",
        ),
    ] = None,
    *,
    settings: Settings,
) -> None:
    """Revoke a token on every service: the router stores it (a restart keeps it), refuses it, closes
    its sessions and tells every provider, which does the same."""
    import sys
    import time

    from libbus.security.auth import inspect_token
    from libbus.wire.messages import RevokeToken

    if what == "-":
        what = sys.stdin.read().strip()
    s = settings
    if what.count(".") == 2:  # a JWT: take its id and expiry from it
        _, claims = inspect_token(what)
        jti, exp = claims.get("jti"), claims.get("exp")
        if not isinstance(jti, str) or not isinstance(exp, (int, float)):
            fail("that token has no jti or exp claim: nothing to revoke", 2)
    else:
        from services.router.grants import LONGEST_TOKEN_S

        # no token busctl mints outlives this (token issue --ttl); the router refuses a longer expiry
        jti, exp = what, time.time() + min(s.token_ttl_s if keep is None else keep, LONGEST_TOKEN_S)
    with admin_client(s) as client:
        client.request(RevokeToken(jti=jti, exp=float(exp), reason=reason))
    typer.echo(f"revoked {jti} until {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(exp))}")


@token_app.command("revoked")
@guard
@admin_options
def token_revoked(*, settings: Settings, json: Json = False) -> None:
    """Tokens revoked and not yet expired, newest first."""
    from libbus.wire.messages import ListRevoked

    s = settings
    with admin_client(s) as client:
        rows = client.request(ListRevoked()).revoked
    print_json(rows) if json else tables.revoked(rows)


@keys_app.command("gen")
@guard
def keys_gen(
    name: Annotated[
        str,
        typer.Argument(help="The key's name: the service (or admin) that uses it; tokens for it carry this subject."),
    ],
    out: Annotated[Path, typer.Option("--dir", help="Where to write NAME.key and NAME.key_secret.")] = Path("."),
) -> None:
    """Create a CURVE key pair: NAME.key_secret (0600, stays on its node; curve_key_file) and
    NAME.key (public: copy it into the authorized directory of every server it connects to;
    the router's goes to every node as curve_router_key)."""
    from libbus.security.curve import generate_keys

    public, secret_path = generate_keys(out, name)
    typer.echo(
        f"public key {public} (copy to the servers' curve_authorized_dir)\n"
        f"secret key {secret_path} (0600, keep it on this node)"
    )


@token_app.command("keygen")
@guard
def token_keygen(
    path: Annotated[
        Path | None,
        typer.Argument(
            help="Where to write the Ed25519 signing key (mode 0600); the public key goes to PATH.pub. "
            "Default: signing_key_file and public_key_file (<state_dir>/token.key, token.pub)."
        ),
    ] = None,
    config: Config = None,
    state_dir: StateDir = None,
) -> None:
    """Create the cluster's EdDSA signing key (keep it on the administrator's machine) and its public key
    (every node's public_key_file: 'busctl token node' hands it out with the node's token). The router
    makes them itself on its first start when neither exists."""
    from libbus.security.auth import generate_signing_key

    if path is None:
        s = settings_from(config, state_dir=state_dir)
        key, pub = generate_signing_key(s.signing_key_file, s.public_key_file)
    else:
        key, pub = generate_signing_key(path)
    typer.echo(f"signing key {key} (0600, keep it private)\npublic key {pub} (copy to every node)")


def _write_unfollowed(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (mode 0644) through a new file renamed over it: a link planted at
    ``path`` is replaced, never followed to write where it points."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


@token_app.command("node")
@guard
def token_node(
    out: Annotated[Path, typer.Argument(help="Where to write the node's files: token.pub and token (0600).")],
    role: Annotated[str, typer.Option(help=f"One of {', '.join(NODE_ROLES)}.")],
    name: Annotated[str, typer.Option(help="The node's subject (its service's name).")],
    ttl: Annotated[float, typer.Option(help="Lifetime in seconds (renew: run this again).")] = NODE_TTL_S,
    dataset: Annotated[
        list[str] | None,
        typer.Option("--dataset", help="Restrict the token to this dataset (repeatable; default: all)."),
    ] = None,
    config: Config = None,
    state_dir: StateDir = None,
    signing_key_file: Annotated[
        str | None, typer.Option("--signing-key-file", help="EdDSA signing key (or BATCHBUS_SIGNING_KEY_FILE).")
    ] = None,
) -> None:
    """On the administrator's machine: what a node needs, and nothing that mints a token. OUT/token.pub
    (the cluster's public key: it checks tokens) and OUT/token (this node's ROLE token). Copy OUT to the
    node, and there set state_dir = OUT (or public_key_file = OUT/token.pub) and token_file = OUT/token."""
    from libbus.security.auth import private_dir, public_key_pem, write_private
    from services.credentials import mint_token, signing_key

    if role not in NODE_ROLES:
        fail(f"--role {role!r}: a node is one of {', '.join(NODE_ROLES)}; admins: busctl token issue --role admin", 2)
    s = settings_from(config, state_dir=state_dir, signing_key_file=signing_key_file)
    if s.token_alg != "EdDSA":
        fail(
            "this cluster runs HS256 (one shared secret, which mints every role: a single trusted machine); "
            "a node of it needs that secret, not a token. Nodes that cannot mint need an EdDSA cluster: "
            "docs/security.md",
            2,
        )
    key = signing_key(s)
    if isinstance(key, bytes):  # token_alg EdDSA: signing_key gives the Ed25519 key
        fail("token_alg is EdDSA but the signing key is a secret", 2)
    private_dir(out)
    mode = out.stat().st_mode
    if mode & 0o022:  # another user could swap token.pub (whose key the node believes) or plant links
        fail(
            f"{out} is writable by its group or by everyone (mode {mode & 0o777:o}): another user there "
            f"could replace the node's public key or token. Use a folder only you can write (chmod go-w {out})",
            2,
        )
    _write_unfollowed(out / "token.pub", public_key_pem(key))
    token = mint_token(s, key, role=role, sub=name, ttl_s=ttl, datasets=dataset or None)
    write_private(out / "token", (token + "\n").encode())
    typer.echo(
        f"{out}/token.pub  the cluster's public key (checks tokens; mints nothing)\n"
        f"{out}/token      {role} token for {name!r}, valid {ttl / 86400:g} days (0600)\n"
        f"copy {out} to the node; there: state_dir = {out} and token_file = {out}/token "
        "(under systemd: the credentials token.pub and token, systemd/README.md)"
    )


@token_app.command("secret")
@guard
def token_secret(path: Annotated[Path, typer.Argument(help="Where to create the secret (mode 0600).")]) -> None:
    """HS256, for a single trusted machine: create the cluster secret file if it does not exist yet.
    Anyone who reads it mints tokens of every role (admin included); a node holding it is an HS256 node
    (token_alg unset). The default set-up is EdDSA (busctl token keygen / token node, docs/security.md)."""
    existed = path.exists()
    ensure_secret(path)
    typer.echo(f"{path} {'already exists' if existed else 'created'}")
