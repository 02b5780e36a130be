"""The router (services/router): the job store, job states, gangs, studies, sample lookups."""
