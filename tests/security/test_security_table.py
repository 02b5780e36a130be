"""docs/security.md §7's table of messages is the services' role tables, written out: every message
the router or a provider answers has a row naming that service and exactly the roles that may send
it (read from the handlers' ``@serves`` marks, so a new message without its row fails here)."""

from __future__ import annotations

import re

from services.provider.handler import ProviderHandler
from services.router.handler import RouterHandler
from tests.support.busctl import REPO


def _table() -> dict[tuple[str, str], set[str]]:
    """(service, message) → roles, from the table's rows."""
    text = (REPO / "docs" / "security.md").read_text()
    section = text[text.index("## 7. What each message checks") :]
    section = section[: section.index("\n## ", 10)]
    rows: dict[tuple[str, str], set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`"):
            continue
        roles = {r.strip() for r in cells[2].split(",")}
        for name in re.findall(r"`(\w+)`", cells[0]):
            rows[cells[1], name] = roles
    return rows


def test_every_message_a_service_answers_has_its_row_with_its_roles():
    rows = _table()
    missing, wrong = [], []
    for service, handler in (("router", RouterHandler), ("provider", ProviderHandler)):
        for name, roles in handler.roles.items():
            shown = rows.get((service, name))
            if shown is None:
                missing.append(f"{name} ({service})")
            elif "any" not in shown and "any session" not in shown and shown != set(roles):
                wrong.append(f"{name} ({service}): table says {sorted(shown)}, the handler {sorted(roles)}")
    assert not missing, f"docs/security.md §7 has no row for {', '.join(missing)}"
    assert not wrong, "; ".join(wrong)
