"""Subprocess used by the kill / concurrency tests: records or ingests events, reporting progress on stdout.

usage: recorder_worker.py record DB JOURNAL START COUNT EVERY [hang]   (prints "recorded N" after every EVERY
                                                                       record() calls; flushes at the end; "hang"
                                                                       then waits to be killed)
       recorder_worker.py ingest DB FILE BATCH                         (prints "done N")
"""

from __future__ import annotations

import sys
import time

from billing_helpers import event

from kvroute.billing.ingest import ingest_file
from kvroute.billing.ledger import Ledger
from kvroute.billing.recorder import UsageRecorder


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "record":
        db, journal, start, count, every = argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5])
        hang = len(argv) > 6 and argv[6] == "hang"
        rec = UsageRecorder(db, journal, batch_size=200, flush_interval_s=0.05, retry_interval_s=0.2).start()
        for i in range(start, start + count):
            rec.record(event(i))
            if (i - start + 1) % every == 0:
                print(f"recorded {i - start + 1}", flush=True)
        if hang:
            time.sleep(600)  # keep the journal locked until killed
        print(f"stored {rec.flush(120)}", flush=True)
        rec.close()
    elif mode == "ingest":
        ledger = Ledger.open(argv[1])
        result = ingest_file(ledger, argv[2], batch_size=int(argv[3]), window=None)  # fixtures are old
        print(f"done {result.inserted}", flush=True)
        ledger.close()


if __name__ == "__main__":
    main(sys.argv[1:])
