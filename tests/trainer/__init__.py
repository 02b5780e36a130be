"""The trainer (services/trainer): its process and attempts, the job API, entrypoint and built-in jobs."""
