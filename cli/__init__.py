"""busctl, the batchbus command line (typer). It only wires settings to services and the admin API."""
