"""What a user meets: busctl, busctl web, the docs' code blocks, examples/, systemd units."""
