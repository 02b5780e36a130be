"""Who gets in and what they may do: tokens, CURVE and ZAP, scopes, confinement, bounds, hostile input."""
