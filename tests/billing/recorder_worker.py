"""Subprocess used by the kill / concurrency tests: records or ingests events, reporting progress on stdout.

usage: recorder_worker.py record DB SPOOL START COUNT FLUSH_EVERY   (prints "flushed N" after each flush)
       recorder_worker.py ingest DB FILE BATCH                       (prints "done N")
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
        db, spool, start, count, every = argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5])
        rec = UsageRecorder(db, spool, batch_size=200, flush_interval_s=0.05, retry_interval_s=0.2).start()
        for i in range(start, start + count):
            rec.record(event(i))
            if (i - start + 1) % every == 0:
                rec.flush(60)
                print(f"flushed {i - start + 1}", flush=True)
        rec.flush(60)
        print(f"flushed {count}", flush=True)
        if len(argv) > 6 and argv[6] == "hang":
            time.sleep(600)  # keep the spool file locked until killed
        rec.close()
    elif mode == "ingest":
        ledger = Ledger.open(argv[1])
        result = ingest_file(ledger, argv[2], batch_size=int(argv[3]), window=None)  # fixtures are old
        print(f"done {result.inserted}", flush=True)
        ledger.close()


if __name__ == "__main__":
    main(sys.argv[1:])
