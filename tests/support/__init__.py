"""What tests share, and the only thing test files import besides conftest's fixtures: one launcher of
service processes (:class:`Cluster`), one ``busctl`` runner, services on threads, metrics scraping, the
source contract (:mod:`.contract`), a range-capable HTTP server (:mod:`.httpd`) and the job tests'
cluster (:mod:`.jobs`, which imports torch: import it from there)."""

from .busctl import BUSCTL, REPO, busctl, busctl_in_process
from .cluster import Cluster, wait_file
from .metrics import scrape, value
from .services import CLUSTER, Running, run_service, wait_job, wait_study

__all__ = [
    "BUSCTL",
    "CLUSTER",
    "REPO",
    "Cluster",
    "Running",
    "busctl",
    "busctl_in_process",
    "run_service",
    "scrape",
    "value",
    "wait_file",
    "wait_job",
    "wait_study",
]
