"""Usage billing: an append-only ledger (SQLite or PostgreSQL) with per-app price books and monthly reports.

Entry points: ``recorder.UsageRecorder`` (request-path recording through a local journal),
``litellm_events.event_from_callback`` (LiteLLM callback payload → ``events.UsageEvent``), ``ledger.Ledger``,
``periods.close_period``, ``reports``; the ``kvroute billing`` / ``kvroute report`` commands live in ``cli``.
"""
