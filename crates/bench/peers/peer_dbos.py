"""Drives DBOS for z29c's benchmark (crates/bench), through its documented API, as peer.mjs
drives the Node systems. The harness measures PostgreSQL, the sink and /proc from outside.

    python peer_dbos.py load '{"url":..,"jobs":N,"steps":S,"concurrency":C}'
    python peer_dbos.py work '{"url":..,"concurrency":C,"sink":URL}'

`load` creates DBOS's system database, registers the queue and enqueues `jobs` workflows of
`steps` steps with DBOS's client, without running any. `work` runs them until SIGTERM: each
step is a `@DBOS.step` making one HTTP POST to the sink, failing unless it is answered 2xx.
The queue is polled every 50 ms (DBOS's default is 1 s, which would cap a drain at
`concurrency` workflows a second).
"""

import json
import signal
import sys
import urllib.request

from dbos import DBOS, DBOSClient, DBOSConfig

QUEUE, WORKFLOW, VERSION = "bench", "bench_run", "bench"
POLL_SECONDS = 0.05

mode, args = sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")
if mode not in ("load", "work"):
    sys.exit(f"peer_dbos.py: unknown mode {mode}")
config: DBOSConfig = {
    "name": "z29c-bench",
    "system_database_url": args["url"],
    "application_version": VERSION,
    "log_level": "WARNING",
    "sys_db_pool_size": args.get("concurrency", 1) + 8,
}
DBOS(config=config)


@DBOS.step()
def post(step: int) -> int:
    request = urllib.request.Request(
        args["sink"],
        data=json.dumps({"step": step}).encode(),
        method="POST",
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request) as answer:
        answer.read()
        return answer.status


@DBOS.workflow(name=WORKFLOW)
def run(steps: int) -> int:
    for i in range(steps):
        post(i)
    return steps


if mode == "load":
    DBOS.launch()
    DBOS.register_queue(
        QUEUE, worker_concurrency=args["concurrency"], polling_interval_sec=POLL_SECONDS
    )
    DBOS.destroy()
    client = DBOSClient(system_database_url=args["url"])
    options = {"queue_name": QUEUE, "workflow_name": WORKFLOW, "app_version": VERSION}
    for _ in range(args["jobs"]):
        client.enqueue(options, args["steps"])
    client.destroy()
    print(json.dumps({"event": "loaded", "jobs": args["jobs"]}), flush=True)
else:
    # DBOS's threads inherit the mask: the signal is taken here, and DBOS stops the documented way
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    DBOS.launch()
    DBOS.register_queue(
        QUEUE, worker_concurrency=args["concurrency"], polling_interval_sec=POLL_SECONDS
    )
    print(json.dumps({"event": "working"}), flush=True)
    signal.sigwait([signal.SIGTERM, signal.SIGINT])
    DBOS.destroy()
